"""Where a run's actors live: the Ray cluster it joins (``ray.address`` or ``$RAY_ADDRESS``), or a local Ray
instance it starts itself; with the cluster's token sent when this machine has one."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import sys
from collections.abc import Iterator

import ray

from rlfabric.config import ConfigError, RayConfig

# How long the auth check waits for a cluster's GCS to answer (the port has answered already): a loaded head's
# reply can take seconds.
GCS_ANSWER_S = 15.0


def use_cluster_token() -> bool:
    """Send the cluster's token when one is at hand (``$RAY_AUTH_TOKEN``, ``$RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``, where ``ray start`` writes it) and ``RAY_AUTH_MODE`` is not set: whether it will be.
    Ray's own switch, the one ``ray start`` uses; call it before Ray's first client is made."""
    from ray._private.authentication.authentication_token_setup import maybe_enable_token_auth_if_token_available

    return maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


def refused_by(gcs_address: str, with_token: bool) -> bool | None:
    """Whether the cluster's GCS at ``host:port`` refuses a request for want of a token (with this machine's
    token in it, or with none); None where it does not answer within ``GCS_ANSWER_S``. One call to the GCS's
    cheapest RPC, which answers in milliseconds where ``ray.init`` would retry for about 20 s; it waits for the
    channel to connect rather than failing at a busy head's first refusal."""
    import grpc
    from ray._raylet import AuthenticationTokenLoader
    from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

    loader = AuthenticationTokenLoader.instance()
    metadata = tuple(loader.get_token_for_http_header(ignore_auth_mode=True).items()) if with_token else ()
    # straight to the GCS, as Ray's own clients go (an http_proxy in the environment would swallow the call)
    with grpc.insecure_channel(gcs_address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        try:
            gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel).GetClusterId(
                gcs_service_pb2.GetClusterIdRequest(), timeout=GCS_ANSWER_S, metadata=metadata, wait_for_ready=True
            )
        except grpc.RpcError as exc:
            return True if exc.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return False


def match_cluster_auth(gcs_address: str, where: str) -> None:
    """Send this machine's token to a cluster under token authentication (``ray start`` turns it on by itself
    where a token exists, and ``ray.init`` would not send one), and not to a cluster without it (whose workers
    could not then answer this driver: its actors would never start); a one-line ConfigError where the token is
    missing, refused, or switched off by ``RAY_AUTH_MODE``. A Ray without token authentication (before 2.52) has
    nothing to match."""
    try:
        from ray._raylet import AuthenticationTokenLoader
    except ImportError:
        return
    wants_token = refused_by(gcs_address, with_token=False)
    mode = os.environ.get("RAY_AUTH_MODE")
    get_it = "`ray get-auth-token` on the head prints it"
    if wants_token is False and mode is not None and mode.lower() == "token":
        raise ConfigError(
            f"{where}: RAY_AUTH_MODE={mode}, but that cluster does not use token authentication (its workers could "
            "not answer this driver): unset RAY_AUTH_MODE"
        )
    if not wants_token:
        return
    if mode is not None and mode.lower() != "token":
        raise ConfigError(f"{where}: that cluster uses token authentication: unset RAY_AUTH_MODE={mode}")
    if not AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
        raise ConfigError(
            f"{where}: that cluster uses token authentication and this machine has no token: set RAY_AUTH_TOKEN, "
            f"or copy the head's ~/.ray/auth_token here ({get_it})"
        )
    if refused_by(gcs_address, with_token=True):
        raise ConfigError(
            f"{where}: that cluster refused this machine's token (from RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
            f"~/.ray/auth_token): give it the cluster's ({get_it})"
        )
    with quiet_auth_log():  # Ray's "set RAY_AUTH_MODE=disabled to opt out" would be wrong advice here
        use_cluster_token()


@contextlib.contextmanager
def quiet_auth_log() -> Iterator[None]:
    """Ray's token-authentication notices silenced: it says on every start that authentication is on."""
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth_log.level
    auth_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        auth_log.setLevel(level)


def ensure_ray(ray_cfg: RayConfig, wanted_cpus: float, env_vars: dict[str, str] | None = None) -> None:
    """Join the cluster at ``ray.address`` (else at ``$RAY_ADDRESS``, as ``ray.init`` reads it), or start a local
    Ray instance with at least ``wanted_cpus``. A cluster that is not there, or that will not take this driver, is a
    one-line ConfigError.

    ``env_vars`` are set in every worker process of a local instance. ``ray.num_cpus`` sizes only a local instance;
    a cluster has the CPUs its nodes were started with.
    """
    if ray.is_initialized():
        return
    address = cluster_address(ray_cfg)
    if address is not None:
        join_cluster(address, ray_cfg)
        return
    num_cpus = ray_cfg.num_cpus or max(os.cpu_count() or 1, math.ceil(wanted_cpus))
    runtime_env = {"env_vars": env_vars} if env_vars else None
    # quiet: token authentication is on for every local instance once a token exists, no news to this run's user.
    # address="local": a new instance even where a cluster (`ray start`) runs on this machine, which ray.init()
    # would join and then refuse num_cpus for
    with quiet_auth_log():
        ray.init(
            address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=True, runtime_env=runtime_env
        )


def cluster_address(ray_cfg: RayConfig) -> str | None:
    """The cluster ``ensure_ray`` joins: ``ray.address``, else ``$RAY_ADDRESS``; None: it starts a local instance."""
    address = ray_cfg.address or os.environ.get("RAY_ADDRESS") or None
    return None if address == "local" else address


def fixed_local_cpus(ray_cfg: RayConfig) -> float | None:
    """The CPUs of the local instance ``ensure_ray`` will start where ``ray.num_cpus`` fixes them; None where Ray
    runs already, a cluster is joined, or the instance is sized to the run."""
    if ray.is_initialized() or cluster_address(ray_cfg) is not None or ray_cfg.num_cpus is None:
        return None
    return float(ray_cfg.num_cpus)


def join_cluster(address: str, ray_cfg: RayConfig) -> None:
    """``ray.init`` at ``address``, after checking that something listens there (Ray would wait minutes on an
    address where nothing does) and that this machine's token is what the cluster wants."""
    where = f"ray.address = {address!r}" if ray_cfg.address else f"RAY_ADDRESS={address!r} (from the environment)"
    hint = (
        "start a cluster there (`ray start --head`), or unset it (ray.address: null, no RAY_ADDRESS) to run on a "
        "local Ray instance"
    )
    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # [::1]:6379
    if host and port.isdigit():
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except OSError as exc:
            raise ConfigError(f"{where}: no Ray cluster answers there ({exc.strerror or exc}); {hint}") from None
    gcs = gcs_address(address)
    if gcs is not None:
        match_cluster_auth(gcs, where)
    if ray_cfg.num_cpus is not None:
        print(
            f"rlfabric: joining the Ray cluster at {where}; ray.num_cpus = {ray_cfg.num_cpus} sizes only a local "
            "instance and is ignored",
            file=sys.stderr,
        )
    try:
        ray.init(address=gcs or address, log_to_driver=True)  # auto: the cluster whose token was matched
    except ConnectionError as exc:  # "auto" with no cluster on this machine
        raise ConfigError(f"{where}: {str(exc).strip().splitlines()[0]}; {hint}") from None


def gcs_address(address: str) -> str | None:
    """The ``host:port`` of the cluster's GCS that ``address`` names (``auto``: the cluster ``ray start`` started
    last on this machine), or None: a Ray Client address (``ray://``), or ``auto`` with no cluster found."""
    if address.startswith("ray://"):
        return None
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address

        try:
            return canonicalize_bootstrap_address("auto")
        except (ConnectionError, ValueError):
            return None
    return address
