"""Launch configurations tuned on a GPU: ``(BLOCK_V, num_warps)`` per card, logits dtype, kernel family and
vocabulary size, read by the launchers from ``tuned.json`` beside this file.

``python -m bench tune`` times each family's :data:`CANDIDATES` on the lent GPU (a candidate that spills there is
dropped) and writes the table; the compile gate (tools/compile_gate.py) compiles every configuration of the
committed table for sm_90 and sm_80, so a tuned configuration is spill-free on both version pairs before it lands.
An entry applies to CUDA tensors of that card (``torch.cuda.get_device_name``) whose rows are 16-byte aligned and
of that dtype, at the nearest tuned vocabulary size within a factor of 2; everything else keeps the launchers'
defaults. Malformed entries are ignored (a table can only choose among valid launches). Families:

* ``fwd``: ``token_logprobs``' forward sweep (``_logprobs_fwd_kernel``);
* ``terms``: the token-terms kernel and the folded DPO / KTO / GRPO kernels with one program a row;
* ``bwd``: the read-and-write passes (``_logprobs_bwd_kernel``, ``_scale_rows_kernel``);
* ``gif``: GRPO's persistent gradient-in-forward grid (``ops/grpo.py``).

The ``"grad_in_forward"`` section (``{card: {dtype: {V: entry}}}``, the same nearest-``V`` rule) says what forms GRPO's
gradient when a caller passes ``grad_in_forward=True`` (:func:`grad_in_forward_entry`): ``"default"`` where a GPU
run measured the option slower than not using it (the default path runs: the gradient formed in the backward),
``"triton"`` (the persistent grid), or ``[CL, threads]`` (the thread-block cluster kernel, ``ops/cluster.py``). A
card, dtype or vocabulary without an entry runs the Triton kernel, as the option asks.
"""
from __future__ import annotations

import contextlib
import json
import os

import torch

TABLE_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned.json")
FAMILIES = ("fwd", "terms", "bwd", "gif")
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# what `bench tune` times, in elements a block for a 2-byte dtype (the defaults first): a thread's share is
# BLOCK_V / (32 num_warps) elements a trip
CANDIDATES = {
    "fwd": ((4096, 4), (2048, 4), (8192, 4), (4096, 8), (8192, 8)),
    "terms": ((4096, 4), (2048, 4), (8192, 4), (4096, 8), (8192, 8)),
    "bwd": ((4096, 8), (2048, 4), (4096, 4), (8192, 8), (8192, 16)),
    "gif": ((8192, 16), (4096, 16), (16384, 16), (4096, 8), (8192, 8)),
}
_WARPS = (1, 2, 4, 8, 16)
PATHS = ("default", "triton")  # the "grad_in_forward" section's named entries (else a cluster's [CL, threads])
CLEARS = []  # the launchers' cached configurations, cleared when the table or a forced candidate changes
_table = None
_forced = {}
_forced_path = []
_paths = {}  # (card, dtype, V) -> the "grad_in_forward" entry
_MISSING = object()
_NAMES = {}  # CUDA device index -> the card's name


def device_name(device: torch.device):
    """The card's name for a CUDA device (the table's key), else None: only CUDA tensors are tuned."""
    return _cuda_name(device.index or 0) if device.type == "cuda" else None


@torch.compiler.assume_constant_result  # a card's name is fixed in a process: torch.compile takes it as a constant
def _cuda_name(index: int) -> str:
    name = _NAMES.get(index)
    if name is None:
        name = _NAMES[index] = torch.cuda.get_device_name(index)
    return name


def table() -> dict:
    """The table as loaded (``{"devices": {name: {dtype: {family: {V: [BLOCK_V, num_warps]}}}}}``); an unreadable
    file is an empty table."""
    global _table
    if _table is None:
        try:
            with open(TABLE_PATH) as f:
                _table = json.load(f)
        except (OSError, ValueError):
            _table = {}
        if not isinstance(_table, dict):
            _table = {}
    return _table


def set_table(t) -> None:
    """Use ``t`` (a dict as in ``tuned.json``; None: read the file again) from now on (tests, ``bench tune``). A
    graph torch.compile traced before keeps the ``"grad_in_forward"`` entries it read (constants of the graph) until
    ``torch._dynamo.reset()``."""
    global _table
    _table = t
    _changed()


@contextlib.contextmanager
def forced(family: str, block: int, warps: int):
    """Within: every launch of ``family`` on any device uses ``(block, warps)`` (clamped to the row as a table
    entry is): ``bench tune``'s candidates and the tests."""
    _forced[family] = (block, warps)
    _changed()
    try:
        yield
    finally:
        _forced.pop(family, None)
        _changed()


@contextlib.contextmanager
def forced_path(path: str):
    """Within: ``grad_in_forward=True`` takes ``path`` (``"default"`` or ``"triton"``) on every device, whatever the
    table says; the innermost of these and ``ops.cluster.forced`` (which forces a cluster configuration the same
    way) wins. Process-wide, not per thread: the benchmarks' and the GPU tests' way to time and test one path."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    with _forcing(path):
        yield


@contextlib.contextmanager
def _forcing(entry):
    _forced_path.append(entry)
    try:
        yield
    finally:
        _forced_path.pop()


def grad_in_forward_entry(logits: torch.Tensor):
    """What forms GRPO's gradient for ``grad_in_forward=True`` on ``logits [..., V]``: a forced path first, else the
    table's ``"grad_in_forward"`` entry for the card, dtype and nearest ``V``: ``"default"``, ``"triton"``, a
    ``(CL, threads)`` pair (checked by ``ops/cluster.py``), or None (no entry: the Triton kernel). Malformed entries
    are skipped."""
    if _forced_path:
        return _forced_path[-1]
    card = device_name(logits.device)
    if card is None:
        return None
    V = logits.shape[-1]
    if torch.compiler.is_compiling():  # (V may be symbolic there: the comparisons below are guards)
        return _nearest_path(_card_paths(card, DTYPES.get(logits.dtype)), V)
    key = (card, logits.dtype, V)
    entry = _paths.get(key, _MISSING)
    if entry is _MISSING:
        entry = _paths[key] = _nearest_path(_card_paths(card, DTYPES.get(logits.dtype)), V)
    return entry


@torch.compiler.assume_constant_result  # torch.compile takes a card's entries as a constant of the graph
def _card_paths(card: str, dtype_key: str) -> tuple:
    """``((V, entry), ...)``: the card's valid ``"grad_in_forward"`` entries for ``dtype_key``, by ``V``."""
    try:
        items = list(table()["grad_in_forward"][card][dtype_key].items())
    except (KeyError, TypeError, AttributeError):
        return ()
    out = []
    for v, entry in items:
        if isinstance(entry, list) and len(entry) == 2 and all(type(e) is int for e in entry):
            entry = tuple(entry)
        elif not (isinstance(entry, str) and entry in PATHS):
            continue
        if str(v).isdigit() and int(v) > 0:
            out.append((int(v), entry))
    return tuple(sorted(out))


def _nearest_path(entries, V):
    """The entry at the tabled size nearest ``V`` (by ratio) within a factor of 2 from ``((size, entry), ...)``, or
    None; integer arithmetic only, so that a symbolic ``V`` under torch.compile compares too."""
    best, best_num, best_den = None, 0, 1
    for v, entry in entries:
        num, den = max(v, V), min(v, V)
        if num <= 2 * den and (best is None or num * best_den < best_num * den):
            best, best_num, best_den = entry, num, den
    return best


def _changed():
    _paths.clear()
    for clear in CLEARS:
        clear()


def lookup(family: str, name, dtype_key, V: int):
    """The tuned ``(BLOCK_V, num_warps)`` for ``family`` on card ``name`` at vocabulary ``V`` (a forced candidate
    first), or None. Called from the launchers' cached configuration functions, not on every call."""
    if family in _forced:
        return _valid(_forced[family])
    if name is None or family not in FAMILIES:
        return None
    try:
        entries = [(int(v), e) for v, e in table()["devices"][name][dtype_key][family].items()]
    except (KeyError, TypeError, AttributeError, ValueError):
        return None
    if any(v <= 0 for v, _ in entries):  # a malformed table is no table
        return None
    return _valid(_nearest_path(entries, V))


def _valid(entry):
    """``(block, warps)`` if ``entry`` is a launch the kernels accept (a power-of-2 block of 8 to 32768 elements,
    1-16 warps, at least one element a thread), else None."""
    try:
        block, warps = (int(v) for v in entry)
    except (TypeError, ValueError):
        return None
    if block < 8 or block > 32768 or block & (block - 1) or warps not in _WARPS or block < 32 * warps:
        return None
    return block, warps


def clamp(entry, V: int, least: int = 8) -> tuple[int, int]:
    """A tuned entry for a row of ``V``: the block no wider than the row's next power of 2 (at least ``least``)."""
    block, warps = entry
    return max(min(block, 1 << max(V - 1, 0).bit_length()), least), warps


def entries(t=None) -> list:
    """Every distinct ``(family, dtype, BLOCK_V, num_warps)`` of a table (the compile gate's cases)."""
    t = table() if t is None else t
    out = set()
    try:
        for per_dtype in (t.get("devices") or {}).values():
            for dtype_key, per_family in (per_dtype or {}).items():
                for family, per_v in (per_family or {}).items():
                    for v, entry in (per_v or {}).items():
                        ok = _valid(entry)
                        if ok and family in FAMILIES and dtype_key in DTYPES.values() and str(v).isdigit():
                            out.add((family, dtype_key, *ok))
    except (AttributeError, TypeError):  # a table of the wrong shape: what was read so far
        pass
    return sorted(out)
