"""A bank as a stateful MCP task server: accounts (id, owner, balance) and a log of transfers, per session.

Tools: ``find_account(owner)`` (the id of owner's account), ``balance(account)``, ``transfer(from_account,
to_account, amount)`` (refuses an overdraft, an unknown account, a transfer to the same account and an amount
under 1) and ``history(account)``. Serve it with ``python -m rlfabric.envs.bank_server`` (stdio) or ``--http PORT``.

Tasks, by number of calls: 1 "Balance of a3?" or "Account of bo?" (one lookup, whose result is the answer);
2 "Balance of bo?" (find_account, balance) or "Send 5 from a2 to bo" (find_account, transfer); 3 "Send 5 from bo
to ana" (find_account twice, transfer); 4 the same, then "balance of ana?" (the answer is the new balance).
"""

from __future__ import annotations

import random

from mcp.server.mcpserver.exceptions import ToolError

from rlfabric.envs.task_server import (
    build_task_server,
    call,
    serve,
    solved_task,
)

OWNERS = ["ana", "bo", "cy", "dee", "eli", "fay", "gus", "hal", "ivy", "jo", "kai", "lu"]


def initial_state(seed: int) -> dict:
    """4-6 accounts ``a1``.. with distinct owners from ``OWNERS`` and balances 10-99, and 0-2 past transfers in
    the log (already reflected in the balances), drawn by ``random.Random(seed)``."""
    rng = random.Random(seed)
    owners = rng.sample(OWNERS, rng.randint(4, 6))
    accounts = {f"a{i}": {"owner": owner, "balance": rng.randint(10, 99)} for i, owner in enumerate(owners, 1)}
    log = []
    for _ in range(rng.randint(0, 2)):
        src, dst = rng.sample(sorted(accounts), 2)
        log.append({"from": src, "to": dst, "amount": rng.randint(1, 9)})
    return {"accounts": accounts, "log": log}


def _account(state: dict, account: str) -> dict:
    if account not in state["accounts"]:
        raise ToolError(f"no account {account!r}")
    return state["accounts"][account]


def find_account(state: dict, owner: str) -> str:
    """The id of owner's account."""
    for account, record in state["accounts"].items():
        if record["owner"] == owner:
            return account
    raise ToolError(f"no account of owner {owner!r}")


def balance(state: dict, account: str) -> str:
    """The balance of the account."""
    return str(_account(state, account)["balance"])


def transfer(state: dict, from_account: str, to_account: str, amount: int) -> str:
    """Move amount from one account to another; refuses an overdraft."""
    src, dst = _account(state, from_account), _account(state, to_account)
    if from_account == to_account:
        raise ToolError(f"cannot transfer from {from_account!r} to itself")
    if amount < 1:
        raise ToolError(f"amount must be at least 1, got {amount}")
    if src["balance"] < amount:
        raise ToolError(f"{from_account} has {src['balance']}, cannot send {amount}")
    src["balance"] -= amount
    dst["balance"] += amount
    state["log"].append({"from": from_account, "to": to_account, "amount": amount})
    return "ok"


def history(state: dict, account: str) -> str:
    """The account's transfers, oldest first, as 'from>to amount' separated by ', ' ('none' if none)."""
    _account(state, account)
    moves = [f"{t['from']}>{t['to']} {t['amount']}" for t in state["log"] if account in (t["from"], t["to"])]
    return ", ".join(moves) or "none"


OPS = [find_account, balance, transfer, history]


def _accounts(state: dict) -> list[str]:
    return sorted(state["accounts"])


def _owner(state: dict, account: str) -> str:
    return state["accounts"][account]["owner"]


def _balance_of_account(state: dict, rng: random.Random) -> dict:
    account = rng.choice(_accounts(state))
    return solved_task(f"Balance of {account}?", state, [call("balance", account=account)], OPS, answer=str)


def _account_of_owner(state: dict, rng: random.Random) -> dict:
    account = rng.choice(_accounts(state))
    owner = _owner(state, account)
    return solved_task(f"Account of {owner}?", state, [call("find_account", owner=owner)], OPS, answer=str)


def _balance_of_owner(state: dict, rng: random.Random) -> dict:
    account = rng.choice(_accounts(state))
    owner = _owner(state, account)
    calls = [call("find_account", owner=owner), call("balance", account=account)]
    return solved_task(f"Balance of {owner}?", state, calls, OPS, answer=str)


def _payment(state: dict, rng: random.Random) -> tuple[str, str, int] | None:
    """Two accounts and an amount the first can pay the second (1-20, at most its balance)."""
    payers = [a for a in _accounts(state) if state["accounts"][a]["balance"] >= 1]
    if not payers or len(state["accounts"]) < 2:
        return None
    src = rng.choice(payers)
    dst = rng.choice([a for a in _accounts(state) if a != src])
    return src, dst, rng.randint(1, min(20, state["accounts"][src]["balance"]))


def _send_to_owner(state: dict, rng: random.Random) -> dict | None:
    if (payment := _payment(state, rng)) is None:
        return None
    src, dst, amount = payment
    owner = _owner(state, dst)
    calls = [call("find_account", owner=owner), call("transfer", from_account=src, to_account=dst, amount=amount)]
    return solved_task(f"Send {amount} from {src} to {owner}", state, calls, OPS)


def _send_between_owners(state: dict, rng: random.Random, then_balance: bool = False) -> dict | None:
    if (payment := _payment(state, rng)) is None:
        return None
    src, dst, amount = payment
    payer, payee = _owner(state, src), _owner(state, dst)
    calls = [
        call("find_account", owner=payer),
        call("find_account", owner=payee),
        call("transfer", from_account=src, to_account=dst, amount=amount),
    ]
    question = f"Send {amount} from {payer} to {payee}"
    if not then_balance:
        return solved_task(question, state, calls, OPS)
    calls.append(call("balance", account=dst))
    return solved_task(f"{question}, then balance of {payee}?", state, calls, OPS, answer=str)


def _send_then_balance(state: dict, rng: random.Random) -> dict | None:
    return _send_between_owners(state, rng, then_balance=True)


MAKERS = {
    1: [_balance_of_account, _account_of_owner],
    2: [_balance_of_owner, _send_to_owner],
    3: [_send_between_owners],
    4: [_send_then_balance],
}


server, STATES, TASK = build_task_server(
    "bank", "bank accounts: look up owners and balances, transfer money (no overdraft)", initial_state, OPS, MAKERS
)


if __name__ == "__main__":
    serve(server)
