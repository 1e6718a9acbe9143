"""The MLX distributed backend a cluster runs on: which one, what each reads, what it costs.

Pure values in, values out; nothing here imports mlx. :func:`availability_of` reads a
passed-in ``mlx.core`` (the rank process has one); :func:`read_availability` asks MLX in a
child process (for the CLI, the proxy and the doctor, which never import mlx; a broken
build cannot take them down with it).

- **Availability** is what MLX reports (``mx.distributed.is_available(backend=...)``):
  ``ring`` wherever MLX imports; ``jaccl`` where RDMA over Thunderbolt 5 is present (macOS
  26.2 or later with ``rdma_ctl enable`` run from recoveryOS); ``nccl`` where MLX is its
  CUDA build (MLX also needs a CUDA device, ``mx.cuda.is_available()``).
- :func:`choose`: ``auto`` takes the first of :data:`PREFERENCE` that is available (ring
  last); a named backend that is not available is refused with what to change.
- :func:`launches`: the environment (and the files it names) each backend reads, as
  ``mlx.launch`` sets them: ring ``MLX_RANK`` + ``MLX_HOSTFILE``; jaccl ``MLX_RANK`` +
  ``MLX_JACCL_COORDINATOR`` + ``MLX_IBV_DEVICES``; nccl ``MLX_RANK`` + ``MLX_WORLD_SIZE`` +
  ``NCCL_HOST_IP``/``NCCL_PORT`` (+ ``CUDA_VISIBLE_DEVICES``, one device per rank in turn).
- :func:`transport_bytes`: the backend's own communication buffers on each rank, with
  where each number comes from (admission counts them as resident: they are allocated
  outside MLX's allocator, so its memory limit never sees them).
- :func:`point_to_point`: MLX's nccl backend has no send/recv (it raises "Send not
  supported"), so the pipeline passes its messages there as all-sums (see
  :class:`plimsoll.cluster.stage.Ring`), which pair two ranks only: :func:`world_refusal`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict

from plimsoll.core.policy import ClusterBackend

Backend = Literal["ring", "jaccl", "nccl"]
BACKENDS: tuple[Backend, ...] = ("ring", "jaccl", "nccl")
#: ``auto``'s order: the first available wins; ring (plain TCP) is the fallback, last.
PREFERENCE: tuple[Backend, ...] = ("nccl", "jaccl", "ring")

#: The variables each backend reads at ``mx.distributed.init`` (MLX's distributed docs,
#: "Distributed Without mlx.launch"); a rank's environment carries its own backend's only.
BACKEND_ENV: dict[Backend, tuple[str, ...]] = {
    "ring": ("MLX_HOSTFILE",),
    "jaccl": ("MLX_JACCL_COORDINATOR", "MLX_IBV_DEVICES", "MLX_JACCL_RING",
              "JACCL_COORDINATOR", "JACCL_IBV_DEVICES", "JACCL_RANK", "JACCL_RING"),
    "nccl": ("NCCL_HOST_IP", "NCCL_PORT", "MLX_WORLD_SIZE"),
}

# ---- each backend's buffers, per rank (MLX 0.32 sources; NCCL's defaults) --------------------
MIB = 1 << 20
#: ring (mlx/distributed/ring/ring.cpp): ``ALL_SUM_BUFFERS`` (2) × ``ALL_SUM_SIZE`` (8 MiB)
#: per socket, host memory, allocated at init; one socket each way, since the hostfile this
#: package writes gives every rank one address.
RING_BYTES_PER_SOCKET = 2 * 8 * MIB
RING_SOCKETS = 2
#: jaccl's mesh (mlx/distributed/jaccl/lib/jaccl/rdma.h, mesh.cpp, mesh_impl.h): for each of
#: ``BUFFER_SIZES`` (8) sizes ``FRAME_SIZE`` (4096) × 2^k, ``NUM_BUFFERS`` (2) × (world mesh
#: slots + 2 × world scatter slots), registered (pinned) for RDMA; plus the mesh's staging,
#: ``MESH_PIPELINE`` (2) × the largest size.
JACCL_SIZES_BYTES = sum(4096 << k for k in range(8))
JACCL_STAGING_BYTES = 2 * (4096 << 7)
#: nccl: NCCL's own device buffers, per channel, per peer, per direction: its default
#: Simple (4 MiB), LL128 (4,915,200 B) and LL (524,288 B) protocol buffers (NCCL's
#: src/init.cc DEFAULT_BUFFSIZE / DEFAULT_LL128_BUFFSIZE / DEFAULT_LL_BUFFSIZE). How many
#: channels NCCL opens depends on the topology and is not known before init: this counts
#: its most, ``MAXCHANNELS`` (32), to every other rank, both ways — a conservative reserve
#: until a measured figure replaces it.
NCCL_BYTES_PER_CHANNEL = 4 * MIB + 4_915_200 + 524_288
NCCL_MAX_CHANNELS = 32


class Availability(BaseModel):
    """What this host's MLX reports; ``error`` when it cannot be asked (MLX will not import)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mlx: str | None = None
    ring: bool = False
    jaccl: bool = False
    nccl: bool = False  # MLX is built with NCCL
    cuda: bool = False  # and sees a CUDA device
    error: str | None = None

    def usable(self, backend: Backend) -> bool:
        if self.error is not None:
            return False
        return {"ring": self.ring, "jaccl": self.jaccl, "nccl": self.nccl and self.cuda}[backend]

    def why_not(self, backend: Backend) -> str:
        """Why ``backend`` is not available here (empty when it is)."""
        if self.error is not None:
            return f"MLX cannot be asked here ({self.error})"
        if self.usable(backend):
            return ""
        if backend == "jaccl":
            return ("MLX reports no RDMA here: jaccl needs Macs joined by Thunderbolt 5 on "
                    "macOS 26.2 or later, with RDMA enabled (`rdma_ctl enable` in recoveryOS)")
        if backend == "nccl":
            return ("MLX here is not its CUDA build" if not self.nccl else
                    "MLX sees no CUDA device") + ": nccl needs NVIDIA GPUs and MLX's CUDA build"
        return "MLX here has no ring backend"

    def summary(self) -> str:
        """One line: each backend, available or why not."""
        if self.error is not None:
            return f"MLX cannot be asked ({self.error})"
        parts = [f"{b} yes" if self.usable(b) else f"{b} no: {self.why_not(b)}"
                 for b in PREFERENCE]
        return f"MLX {self.mlx} distributed: " + "; ".join(parts)


class Choice(BaseModel):
    """The backend to run on, or (``backend`` None) why there is none; ``reason`` says which."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wanted: ClusterBackend
    backend: Backend | None
    reason: str


def choose(wanted: ClusterBackend, available: Availability, *, setting: str,
           local: bool = False) -> Choice:
    """The backend for ``wanted`` (``setting`` names where it was set, for the fix).

    ``local``: every rank runs on this host, so jaccl (which links separate Macs) is out.
    """
    def fits(b: Backend) -> str:
        if local and b == "jaccl":
            return ("jaccl links separate Macs over Thunderbolt 5 RDMA, but these ranks all "
                    "run on this host (across hosts, start them with mlx.launch --backend "
                    "jaccl: README, clustered mode)")
        return available.why_not(b)

    if wanted == "auto":
        for b in PREFERENCE:
            if not fits(b):
                skipped = PREFERENCE[:PREFERENCE.index(b)]
                return Choice(wanted=wanted, backend=b, reason=f"auto: {b}" + (
                    f", as {' and '.join(skipped)} cannot run here" if skipped else ""))
        return Choice(wanted=wanted, backend=None,
                      reason=f"{setting} auto: no MLX distributed backend here ({fits('ring')})")
    why = fits(wanted)
    if not why:
        return Choice(wanted=wanted, backend=wanted,
                      reason=f"named by {setting}, available here")
    others = [b for b in PREFERENCE if not fits(b)]
    fix = (f"set {setting} to \"auto\" or {' or '.join(repr(b) for b in others)}" if others
           else "install MLX")
    return Choice(wanted=wanted, backend=None,
                  reason=f"{setting} is {wanted!r} but {why}: {fix}")


def point_to_point(backend: Backend) -> bool:
    """Whether MLX's ``backend`` has send/recv (its nccl backend raises on both)."""
    return backend != "nccl"


def world_refusal(backend: Backend, world: int) -> str:
    """Why ``world`` ranks cannot run the pipeline over ``backend`` (empty when they can)."""
    if not point_to_point(backend) and world > 2:
        return (f"MLX's {backend} backend has no send/recv: the pipeline passes each message "
                f"as an all-sum, which pairs two ranks only, not {world}: use two ranks, or "
                "ring")
    return ""


class TransportCost(BaseModel):
    """One rank's backend buffers, and where the figure comes from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Backend
    bytes: int
    source: str


def transport_bytes(backend: Backend, world: int) -> TransportCost:
    """The buffers ``backend`` itself allocates on each rank of a ``world``-rank group."""
    if world <= 1:
        return TransportCost(backend=backend, bytes=0, source="one rank: no group")
    if backend == "ring":
        return TransportCost(
            backend=backend, bytes=RING_SOCKETS * RING_BYTES_PER_SOCKET,
            source="MLX ring.cpp: 2 sockets x ALL_SUM_BUFFERS 2 x ALL_SUM_SIZE 8 MiB")
    if backend == "jaccl":
        return TransportCost(
            backend=backend, bytes=2 * 3 * world * JACCL_SIZES_BYTES + JACCL_STAGING_BYTES,
            source=f"MLX jaccl mesh: NUM_BUFFERS 2 x 3 x {world} ranks x "
                   "sum(4096 << k, k < 8) + staging 2 x 512 KiB")
    return TransportCost(
        backend=backend, bytes=(world - 1) * 2 * NCCL_MAX_CHANNELS * NCCL_BYTES_PER_CHANNEL,
        source=f"NCCL defaults, conservative: {world - 1} peer(s) x 2 directions x "
               f"MAXCHANNELS {NCCL_MAX_CHANNELS} x (Simple 4 MiB + LL128 4,915,200 B + "
               "LL 524,288 B)")


# ---- launching: the environment each backend reads -----------------------------------------


class RankLaunch(BaseModel):
    """What one rank's process gets: variables, and files (variable → content) whose paths
    the launcher writes into those variables."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: dict[str, str]
    files: dict[str, str] = {}


def ring_hostfile(ips_ports: Sequence[tuple[str, int]]) -> str:
    """The ring backend's hostfile JSON: one list of ``ip:port`` per rank (as mlx.launch)."""
    return json.dumps([[f"{ip}:{port}"] for ip, port in ips_ports])


def launches(backend: Backend, addresses: Sequence[tuple[str, int]], *,
             rdma_devices: Sequence[Sequence[str | None]] | None = None,
             visible_devices: Sequence[str] = ()) -> list[RankLaunch]:
    """Each rank's environment for ``backend`` (``addresses``: rank → (ip, port); ring
    listens on every one, jaccl and nccl only on rank 0's). One rank: no group at all.

    jaccl needs ``rdma_devices`` (rank × rank, ``None`` on the diagonal: the RDMA device
    linking each pair, as ``mlx.distributed_config`` writes it). nccl gives rank r the
    device ``visible_devices[r % len]`` when any are given (as ``mlx.launch`` does)."""
    world = len(addresses)
    if world <= 1:
        return [RankLaunch(env={}) for _ in addresses]
    out = []
    ip0, port0 = addresses[0]
    for rank in range(world):
        env = {"MLX_RANK": str(rank)}
        files: dict[str, str] = {}
        if backend == "ring":
            files["MLX_HOSTFILE"] = ring_hostfile(addresses)
        elif backend == "jaccl":
            if rdma_devices is None or len(rdma_devices) != world:
                raise ValueError(f"jaccl needs the RDMA device between every pair of the "
                                 f"{world} ranks (MLX_IBV_DEVICES)")
            env["MLX_JACCL_COORDINATOR"] = f"{ip0}:{port0}"
            files["MLX_IBV_DEVICES"] = json.dumps([list(row) for row in rdma_devices])
        else:
            env |= {"MLX_WORLD_SIZE": str(world), "NCCL_HOST_IP": ip0, "NCCL_PORT": str(port0)}
            if visible_devices:
                env["CUDA_VISIBLE_DEVICES"] = visible_devices[rank % len(visible_devices)]
        out.append(RankLaunch(env=env, files=files))
    return out


def backend_from_env(env: Mapping[str, str]) -> Backend | None:
    """The backend a launcher set this process up for (None: no group, one rank)."""
    if env.get("MLX_HOSTFILE"):
        return "ring"
    if env.get("MLX_JACCL_COORDINATOR") or env.get("JACCL_COORDINATOR"):
        return "jaccl"
    if env.get("NCCL_HOST_IP"):
        return "nccl"
    return None


# ---- asking MLX ---------------------------------------------------------------------------


def availability_of(mx) -> Availability:
    """What the given ``mlx.core`` reports (the rank process passes its own)."""
    try:
        dist = mx.distributed
        return Availability(
            mlx=getattr(mx, "__version__", "?"),
            **{b: bool(dist.is_available(backend=b)) for b in BACKENDS},
            cuda=bool(mx.cuda.is_available()))
    except Exception as err:  # an MLX too old for is_available(backend=...), a broken build
        return Availability(error=f"{type(err).__name__}: {err}")


_PROBE = """
import json
try:
    import mlx.core as mx
except Exception as err:
    print(json.dumps({"error": f"{type(err).__name__}: {err}"}))
else:
    from plimsoll.cluster.backend import availability_of
    print(availability_of(mx).model_dump_json())
"""


def read_availability(python: str = sys.executable, timeout: float = 120.0) -> Availability:
    """What MLX reports in a child process of ``python`` (the interpreter ranks run on)."""
    try:
        done = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                              timeout=timeout)
        return Availability.model_validate_json(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as err:
        return Availability(error=f"the MLX probe failed: {type(err).__name__}: {err}")
