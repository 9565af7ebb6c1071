"""VerifiersHost: an environment written with the ``verifiers`` library, run unchanged in an actor of its own.

``verifiers`` environments (``SingleTurnEnv``, ``MultiTurnEnv``, ``ToolEnv``, their ``Rubric``) drive a model
through an OpenAI client and score the conversation with the rubric's functions. The library pins packages that
rlfabric cannot share a Python environment with (``mcp`` < 2), so the environment lives in this actor, started
with a Ray runtime env (``env.verifiers.pip``: a virtualenv on top of rlfabric's, made once per node and session).

The host loads the environment once (``vf.load_environment(name, **args)``, or a ``package.module:function``
that returns one), hands the driver its dataset rows and the rubric's functions and weights, and rolls out one
dataset row per call against the base URL and key it is given: the rollout worker's endpoint and the episode's
session, so every model call is the policy's turn, recorded token for token there. The rubric's functions become
the episode's named reward components (``verifiers_agent``).

Written against the library's classic environment API (verifiers 0.3.x: ``Environment.run_rollout``, the rubric's
function names and weights); verifiers 0.4.0 removed that API (only ``verifiers.v1`` remains).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import signal
import ssl
import threading
from typing import Any

import ray

HOST_NAME_PREFIX = "rlfabric-verifiers-"
# Rollout errors the model caused (an empty reply): the episode is scored by the rubric like any other, so the
# policy learns from it; any other error (the environment's, a refused call) fails the episode.
MODEL_ERRORS = ("EmptyModelResponseError",)


def _load(spec: str, args: dict[str, Any]) -> Any:
    """The environment ``spec`` names, built with ``args``. The library sets SIGINT/SIGTERM handlers for its
    teardown when an environment is built, which Python allows only in a main thread, and a Ray actor with
    concurrent calls builds it in another: there the handlers are skipped (Ray owns the actor's signals; the
    host's ``close`` runs the teardown)."""
    if threading.current_thread() is threading.main_thread():
        return _build(spec, args)
    real = signal.signal
    signal.signal = lambda signum, handler: signal.getsignal(signum)  # type: ignore[assignment]
    try:
        return _build(spec, args)
    finally:
        signal.signal = real


def _build(spec: str, args: dict[str, Any]) -> Any:
    import datasets
    import verifiers as vf

    datasets.disable_progress_bars()  # the dataset maps' bars would interleave with the run's progress lines

    if ":" in spec:
        from rlfabric.shipping import import_callable

        factory = import_callable(spec)
        if not callable(factory):
            raise ValueError(f"{spec!r} names nothing callable")
        return factory(**args)
    return vf.load_environment(spec, **args)


def _failure(exc: BaseException) -> str:
    """``Type: message`` of a failed load, with what caused it (the library wraps an import error in a ValueError
    that does not say which module was missing)."""
    text = f"{type(exc).__name__}: {exc}"
    cause = exc.__cause__ or exc.__context__
    return f"{text} ({type(cause).__name__}: {cause})" if cause is not None else text


def _not_a_model_error(record: logging.LogRecord) -> bool:
    """False for the library's "Aborted rollout due to EmptyModelResponseError" line: an empty reply is the
    model's doing, scored like any reply, and was one ERROR line per episode in the run's output."""
    text = record.getMessage()
    return not (text.startswith("Aborted rollout due to") and any(kind in text for kind in MODEL_ERRORS))


def quiet_model_errors() -> None:
    """Add ``_not_a_model_error`` to every logger of the library built so far (the environment's own is made when
    it loads): a logger's filter sees the records it makes, which its parents' filters do not."""
    names = [n for n in logging.root.manager.loggerDict if n == "verifiers" or n.startswith("verifiers.")]
    for name in names:
        logger = logging.getLogger(name)
        if _not_a_model_error not in logger.filters:
            logger.addFilter(_not_a_model_error)


def _plain(value: Any) -> Any:
    """A dataset value as plain JSON data (rows travel to the driver and back into the rollout)."""
    return json.loads(json.dumps(value, default=str))


# Threaded, not async (an async actor is built off the main thread, where the library's signal handlers fail): each
# call waits on the host's one rollout loop in a thread of its own; the driver sets max_concurrency to the episodes
# a run can have in flight, so none waits in Ray's queue while its deadline runs.
@ray.remote(num_cpus=0, max_restarts=3)
class VerifiersHost:
    """See the module docstring. ``spec``: ``env.verifiers.id``; ``args``: its keyword arguments. An environment
    that does not load is kept as ``load_error`` and reported by ``describe``: an actor whose constructor raises
    dies, and its process prints the traceback, a native stack and "Fatal Python error: Aborted" into the run's
    output beside the one line the driver prints."""

    def __init__(self, spec: str, args: dict[str, Any]) -> None:
        self.load_error: str | None = None
        try:
            self.env = _load(spec, args)
        except Exception as exc:  # noqa: BLE001 - the environment's or its packages' failure: told by describe
            self.load_error = _failure(exc)
            return
        logging.getLogger("verifiers").setLevel(logging.ERROR)  # each aborted rollout is reported to the run anyway
        quiet_model_errors()
        # One event loop runs every rollout (as the library's own generate does), on a thread of its own; their
        # clients share one connection pool, whose TLS context is made once (a new one costs ~20 ms).
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="verifiers-rollouts", daemon=True).start()
        self.http: Any = None

    def describe(self, num_train: int | None, num_eval: int) -> dict[str, Any]:
        """The environment's rows and rubric: ``train`` (at most ``num_train`` rows of its dataset), ``eval`` (its
        eval dataset's first ``num_eval`` rows; without one, the ``num_eval`` dataset rows after ``train``), and
        ``weights``: each rubric function's weight by name (monitors weigh 0); or ``error`` alone, why the
        environment did not load."""
        if self.load_error is not None:
            return {"error": self.load_error}
        train = [_plain(dict(r)) for r in self.env.get_dataset()]
        has_eval = getattr(self.env, "eval_dataset", None) is not None or callable(
            getattr(self.env, "eval_dataset_builder", None)
        )
        held_out = [_plain(dict(r)) for r in self.env.get_eval_dataset()] if has_eval else train[len(train) // 2 :]
        if not has_eval:  # no eval split: the second half is held out
            train = train[: len(train) // 2]
        rubric = self.env.rubric
        # the classic API's names and weights of the rubric's functions (a RubricGroup's across its rubrics)
        names, weights = rubric._get_reward_func_names(), rubric._get_reward_weights()
        return {
            "train": train[:num_train] if num_train else train,
            "eval": held_out[:num_eval],
            "weights": dict(zip(names, (float(w) for w in weights), strict=True)),
        }

    def close(self) -> None:
        """Run the environment's teardown handlers (what its signal handlers would have run)."""
        if self.load_error is not None:
            return
        teardown = getattr(self.env, "_teardown", None)
        if callable(teardown):
            asyncio.run(teardown())

    def rollout(self, row: dict[str, Any], base_url: str, api_key: str, model: str, deadline_s: float) -> dict:
        """One rollout of ``row`` against the endpoint at ``base_url``: the rubric's values by function name
        (``metrics``), the weighted ``reward``, and the rollout's ``error`` (None when it ran to its end). A
        rollout still running after ``deadline_s`` is cancelled, so it never holds a thread."""
        future = asyncio.run_coroutine_threadsafe(self._rollout(row, base_url, api_key, model, deadline_s), self.loop)
        try:
            return future.result(timeout=deadline_s + 5)
        except TimeoutError:
            future.cancel()
            return {"metrics": {}, "reward": 0.0, "error": f"missed its {deadline_s:g}s deadline", "error_kind": None}

    def _rollout(self, row: dict[str, Any], base_url: str, api_key: str, model: str, deadline_s: float) -> Any:
        # not itself a coroutine function: an actor with one would be an async actor, built off the main thread
        return asyncio.wait_for(_rollout(self, row, base_url, api_key, model, deadline_s), deadline_s)


async def _rollout(
    host: Any, row: dict[str, Any], base_url: str, api_key: str, model: str, deadline_s: float
) -> dict[str, Any]:
    """``VerifiersHost.rollout`` on the host's loop: ``error`` is the rollout's error text and ``error_kind`` the
    library's name for it (``EmptyModelResponseError`` is the model's doing, scored like any reply)."""
    import openai
    import verifiers as vf

    if host.http is None:
        host.http = openai.DefaultAsyncHttpxClient(verify=ssl.create_default_context())
    client = openai.AsyncOpenAI(
        base_url=base_url, api_key=api_key, max_retries=0, timeout=deadline_s, http_client=host.http
    )
    out = await host.env.run_rollout(row, vf.OpenAIChatCompletionsClient(client), model, None)
    error = out.get("error")
    kind = error.get("error") if isinstance(error, dict) else type(error).__name__ if error else None
    return {
        "metrics": {k: float(v) for k, v in (out.get("metrics") or {}).items()},
        "reward": float(out.get("reward") or 0.0),
        "error": None if not error else f"{kind}: {error.get('message', '') if isinstance(error, dict) else error}",
        "error_kind": kind,
    }


@functools.cache
def _host(name: str) -> Any:
    return ray.get_actor(name)  # looked up once per process, not per episode


def verifiers_agent(host_name: str, accuracy: str, deadline_s: float) -> Any:
    """The agent function of a verifiers environment: each episode is one rollout of its task row on the host
    named ``host_name`` against the episode's client; its rubric values are the reward components, with
    ``correct`` (1 when the ``accuracy`` function's value is positive) added for the held-out accuracy when the
    rubric has no function of that name. A rollout that ended in an error fails its episode with it."""

    async def run(task: dict[str, Any], client: Any) -> dict[str, float]:
        try:
            out = await _host(host_name).rollout.remote(
                task, str(client.base_url), client.api_key, "policy", deadline_s
            )
        except ray.exceptions.RayError as exc:  # the host's own failure: its last line, not a remote traceback
            lines = str(exc).strip().splitlines()
            raise RuntimeError(f"the verifiers host failed: {lines[-1] if lines else type(exc).__name__}") from None
        if out["error"] is not None and out["error_kind"] not in MODEL_ERRORS:
            raise RuntimeError(f"the verifiers rollout ended in an error: {out['error']}")
        components = dict(out["metrics"])
        components.setdefault("correct", float(components.get(accuracy, 0.0) > 0))
        return components

    run.__qualname__ = f"verifiers_agent({host_name!r})"
    return run
