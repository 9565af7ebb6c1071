"""A shop as a stateful MCP task server: an inventory (item, stock, price) and open orders, per session.

Tools: ``stock(item)``, ``price(item)``, ``place_order(item, quantity)`` (takes the quantity from stock; refuses
more than is left; returns the new order's id), ``cancel_order(order_id)`` (puts its quantity back) and
``list_orders()``. Serve it with ``python -m rlfabric.envs.shop_server`` (stdio) or ``--http PORT``.

Tasks, by number of calls: 1 "Stock of pen?" (one lookup) or "Order 2 pen"; 2 "Cancel the cup order"
(list_orders, cancel_order) or "Order all pen left" (stock, place_order); 3 "Change the cup order to 3"
(list_orders, cancel_order, place_order).
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

ITEMS = ["pen", "cup", "mug", "hat", "bag", "map", "box", "jar", "fan", "lamp", "bell", "bowl", "sock", "cap"]


def initial_state(seed: int) -> dict:
    """4-6 items from ``ITEMS`` (stock 1-9, price 1-20) and 2-3 open orders of distinct items (quantity 1-3,
    ids o1, o2, ..), drawn by ``random.Random(seed)``. Ids carry a letter so that no id reads like a quantity."""
    rng = random.Random(seed)
    names = rng.sample(ITEMS, rng.randint(4, 6))
    items = {name: {"stock": rng.randint(1, 9), "price": rng.randint(1, 20)} for name in names}
    ordered = rng.sample(names, rng.randint(2, 3))
    orders = {f"o{i}": {"item": name, "qty": rng.randint(1, 3)} for i, name in enumerate(ordered, 1)}
    return {"items": items, "orders": orders, "next_order": len(orders) + 1}


def _item(state: dict, item: str) -> dict:
    if item not in state["items"]:
        raise ToolError(f"no item {item!r}")
    return state["items"][item]


def stock(state: dict, item: str) -> str:
    """How many of the item are in stock."""
    return str(_item(state, item)["stock"])


def price(state: dict, item: str) -> str:
    """The price of one of the item."""
    return str(_item(state, item)["price"])


def place_order(state: dict, item: str, quantity: int) -> str:
    """Order quantity of the item (taken from stock); returns the new order's id."""
    record = _item(state, item)
    if quantity < 1:
        raise ToolError(f"quantity must be at least 1, got {quantity}")
    if quantity > record["stock"]:
        raise ToolError(f"only {record['stock']} {item} left, cannot order {quantity}")
    record["stock"] -= quantity
    order_id = f"o{state['next_order']}"
    state["orders"][order_id] = {"item": item, "qty": quantity}
    state["next_order"] += 1
    return order_id


def cancel_order(state: dict, order_id: str) -> str:
    """Cancel the order and put its items back in stock."""
    order = state["orders"].pop(order_id, None)
    if order is None:
        raise ToolError(f"no order {order_id!r}")
    state["items"][order["item"]]["stock"] += order["qty"]
    return "ok"


def list_orders(state: dict) -> str:
    """The open orders as 'id item quantity', separated by ', ' ('none' if none)."""
    ids = sorted(state["orders"], key=lambda order_id: int(order_id[1:]))
    return ", ".join(f"{i} {state['orders'][i]['item']} {state['orders'][i]['qty']}" for i in ids) or "none"


OPS = [stock, price, place_order, cancel_order, list_orders]


def _items(state: dict) -> list[str]:
    return sorted(state["items"])


def _stock_of(state: dict, rng: random.Random) -> dict:
    item = rng.choice(_items(state))
    return solved_task(f"Stock of {item}?", state, [call("stock", item=item)], OPS, answer=str)


def _order(state: dict, rng: random.Random) -> dict | None:
    stocked = [item for item in _items(state) if state["items"][item]["stock"] >= 1]
    if not stocked:
        return None
    item = rng.choice(stocked)
    quantity = rng.randint(1, min(3, state["items"][item]["stock"]))
    return solved_task(f"Order {quantity} {item}", state, [call("place_order", item=item, quantity=quantity)], OPS)


def _order_all(state: dict, rng: random.Random) -> dict | None:
    stocked = [item for item in _items(state) if state["items"][item]["stock"] >= 1]
    if not stocked:
        return None
    item = rng.choice(stocked)
    calls = [call("stock", item=item), call("place_order", item=item, quantity=state["items"][item]["stock"])]
    return solved_task(f"Order all {item} left", state, calls, OPS)


def _single_orders(state: dict) -> dict[str, str]:
    """Items with exactly one open order -> that order's id ("the cup order" must name one order)."""
    ids: dict[str, list[str]] = {}
    for order_id, order in state["orders"].items():
        ids.setdefault(order["item"], []).append(order_id)
    return {item: found[0] for item, found in sorted(ids.items()) if len(found) == 1}


def _cancel(state: dict, rng: random.Random) -> dict | None:
    if not (single := _single_orders(state)):
        return None
    item = rng.choice(sorted(single))
    calls = [call("list_orders"), call("cancel_order", order_id=single[item])]
    return solved_task(f"Cancel the {item} order", state, calls, OPS)


def _change(state: dict, rng: random.Random) -> dict | None:
    single = _single_orders(state)
    # after the cancel, the stock holds the old quantity too; the new quantity must differ from the old one
    room = {item: state["items"][item]["stock"] + state["orders"][order_id]["qty"] for item, order_id in single.items()}
    items = [item for item in sorted(single) if room[item] >= 2]
    if not items:
        return None
    item = rng.choice(items)
    order_id, old = single[item], state["orders"][single[item]]["qty"]
    quantity = rng.choice([q for q in range(1, min(5, room[item]) + 1) if q != old])
    calls = [
        call("list_orders"),
        call("cancel_order", order_id=order_id),
        call("place_order", item=item, quantity=quantity),
    ]
    return solved_task(f"Change the {item} order to {quantity}", state, calls, OPS)


MAKERS = {1: [_stock_of, _order], 2: [_cancel, _order_all], 3: [_change]}


server, STATES, TASK = build_task_server(
    "shop", "a shop: look up stock, place, cancel and change orders", initial_state, OPS, MAKERS
)


if __name__ == "__main__":
    serve(server)
