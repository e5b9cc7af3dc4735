"""Our logits-path kernels next to Liger's ``triton_grpo_loss``, compiled for a GPU on a CPU-only machine (issue 53).

``python -m bench.compare_compiled [--arch 90 [80]] [--vocab 128256 32000] [--n 8192] [--only SUBSTR ...]
[--asm DIR] [--out DIR]``

Each case is the call ``python -m bench logits`` times (forward + backward, bf16 logits ``[1, N, V]``; Liger's
``[1, N + 1, V]`` as the bench passes them), run on ``meta`` tensors with every Triton launch compiled instead of
launched: Triton's own ``JITFunction.run`` specialises the arguments exactly as at run time and builds for
``GPUTarget("cuda", arch, 32)`` with the ptxas inside the triton wheel (the compile gate's way,
tests/compile_gate.py); launch parameters (grid, ``num_warps``, block sizes) are the launchers' own. Per compiled
kernel it prints registers, local memory, shared memory, warps, programs and rows per program, an occupancy estimate,
the global loads and stores of the PTX (vector width, cache and eviction hints) and of the SASS, each loop's SASS
instructions per trip and per element, and what runs after the hot loop. Per case it counts the device launches of
one forward + backward (Triton launches and the aten ops that are kernels on a GPU). Nothing is launched and no
kernel is changed; the output is deterministic for given torch / triton / Liger versions.

Writes ``<out>/compare_compiled.json`` (versions, shapes, every number printed); progress goes to stderr.
"""
from __future__ import annotations

import collections
import contextlib
import gc
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import warnings

import torch

from .cli import Parser

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench logits' rows of these names (an older version's kernels: run this at that version, from git)
CASES = ("hk.token_logprobs", "hk.fused.grpo", "hk.fused.grpo(grad_in_fwd)", "hk.fused.dpo", "hk.fused.kto",
         "liger triton_grpo_loss")
SHORT = dict(zip(CASES, ("tlp", "grpo", "grpo-gif", "dpo", "kto", "liger")))  # the summary's "used by" column
# per-SM limits of the occupancy estimate: registers, threads, resident CTAs, shared memory, reserved a CTA (bytes)
LIMITS = {90: (65536, 2048, 32, 228 * 1024, 1024), 80: (65536, 2048, 32, 164 * 1024, 1024)}


def _say(msg):
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ compiling, not launching
@contextlib.contextmanager
def compiling(arch, launches):
    """Every Triton launch inside compiles for ``sm_<arch>`` (Triton's own specialisation, ``warmup=True``) and is
    appended to ``launches`` as ``(kernel name, grid, bound arguments, compiled kernel)``; ``meta`` tensors take our
    compiled-kernel branch. Fresh per-device caches for the while: the stand-in's device 0 is one arch at a time."""
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    from bench.host_proxy import StandInDriver
    from humanline_kernels.ops import _jit

    with warnings.catch_warnings():  # isinstance() on every object wakes torch's deprecated module attributes
        warnings.simplefilter("ignore")
        jfs = [o for o in gc.get_objects() if isinstance(o, JITFunction)]
    saved = [(jf, jf.device_caches) for jf in jfs]
    previous, original = driver._active, JITFunction.run
    driver.set_active(StandInDriver(arch))  # before any binder is made: binders read the driver's target
    for jf in jfs:
        jf.device_caches = collections.defaultdict(jf.create_binder)

    def run(self, *args, grid, warmup, **kwargs):
        bound = dict(zip([p.name for p in self.params], args))
        bound.update(kwargs)
        kernel = original(self, *args, grid=grid, warmup=True, **kwargs)
        g = grid(bound) if callable(grid) else grid
        launches.append((self.fn.__name__, tuple(g) + (1,) * (3 - len(g)), bound, kernel))
        return kernel

    JITFunction.run = run
    added = "meta" not in _jit.COMPILED_DEVICES
    _jit.COMPILED_DEVICES.add("meta")
    try:
        yield
    finally:
        JITFunction.run = original
        if added:
            _jit.COMPILED_DEVICES.discard("meta")
        for jf, caches in saved:
            jf.device_caches = caches
        driver.set_active(previous)


# ops that launch nothing on a GPU (tests/test_launch_budget.py's list): views, metadata, allocation without a fill
_FREE = {"view", "_unsafe_view", "slice", "select", "expand", "t", "transpose", "detach", "alias", "as_strided",
         "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "unsqueeze", "squeeze", "permute",
         "reshape", "_reshape_alias", "lift_fresh", "unbind", "split", "split_with_sizes", "diagonal", "narrow",
         "_assert_tensor_metadata", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
         "_local_scalar_dense"}


def _aten_counter():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("to", "contiguous", "_to_copy") and args and out is args[0]:
                return out  # no copy made
            if name not in _FREE:
                self.ops[name] += 1
            return out
    return Count()


def case_calls(N, V):
    """name -> a forward + backward on ``meta`` tensors, as ``bench/bench_logits.py`` calls it."""
    import humanline_kernels as hk
    meta = dict(device="meta")
    x = torch.empty(1, N, V, dtype=torch.bfloat16, **meta).requires_grad_()
    y = torch.empty(1, N, dtype=torch.int64, **meta)
    ref = torch.empty(1, N, **meta)
    g = torch.empty(1, N, **meta)
    adv = torch.empty(1, **meta)
    half = ref.new_empty(2, N // 2)
    des = torch.empty(2, dtype=torch.bool, **meta)

    def grad(out, go=None, wrt=x):
        return torch.autograd.grad(out, wrt, go)[0]

    calls = {
        "hk.token_logprobs": lambda: grad(hk.token_logprobs(x, y, validate=False), g),
        "hk.fused.grpo": lambda: grad(hk.fused.grpo(x, y, ref, adv, beta=0.04, validate=False)[0]),
        "hk.fused.grpo(grad_in_fwd)": lambda: grad(hk.fused.grpo(x, y, ref, adv, beta=0.04, validate=False,
                                                                 grad_in_forward=True)[0]),
        "hk.fused.dpo": lambda: grad(hk.fused.dpo(x.view(2, N // 2, V), y.view(2, -1), half, validate=False)[0]),
        "hk.fused.kto": lambda: grad(hk.fused.kto(x.view(2, N // 2, V), y.view(2, -1), half, des,
                                                  validate=False)[0]),
    }
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss
    except Exception as e:
        _say(f"liger-kernel not importable ({type(e).__name__}): its case is skipped "
             "(pip install liger-kernel --no-deps)")
        return calls
    xl = torch.empty(1, N + 1, V, dtype=torch.bfloat16, **meta).requires_grad_()  # Liger wants [B, L + 1, V]

    def liger():
        out = triton_grpo_loss(xl, None, ref, y, adv, temperature=1.0, beta=0.04, loss_type="dapo", reduce=True)
        return torch.autograd.grad(out[0] if isinstance(out, tuple) else out, xl)[0]
    calls["liger triton_grpo_loss"] = liger
    return calls


# ------------------------------------------------------------------------------------------ reading the binaries
def _tool(name):
    import triton.backends.nvidia as nv
    path = os.path.join(os.path.dirname(nv.__file__), "bin", name)
    return path if os.path.exists(path) else None


def _run_tool(name, *args):
    path = _tool(name)
    if path is None:
        return None
    return subprocess.run([path, *args], capture_output=True, text=True, check=True).stdout


def resources(cubin):
    """``{registers, stack, local, shared_static}`` from ``cuobjdump -res-usage`` (what ptxas allocated)."""
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "k.cubin")
        with open(p, "wb") as f:
            f.write(cubin)
        res = _run_tool("cuobjdump", "-res-usage", p)
        sass = _run_tool("nvdisasm", "-c", p)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", res or "")
    out = dict(zip(("registers", "stack", "shared_static", "local"), map(int, m.groups()))) if m else {}
    return out, sass


_SASS_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_PTX_LABEL = re.compile(r"^(\$L__BB\d+_\d+):")
_PTX_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][A-Za-z0-9_.:]*)\b([^;]*);")


def instructions(text, kind):
    """``[(opcode, operands)]`` and ``{label: index}`` of the kernel's own code (SASS: up to the first internal
    subroutine such as the int64 division helper; PTX: the ``.entry`` body)."""
    out, labels, started = [], {}, kind == "ptx"
    for line in text.splitlines():
        s = line.strip()
        if kind == "sass":
            if s.startswith(".text.") and s.endswith(":"):
                started = True
                continue
            if started and s.startswith(".type") and out:
                break  # an internal subroutine follows the kernel
            m = _SASS_LABEL.match(s)
            if m:
                labels[m.group(1)] = len(out)
                continue
            m = _SASS_INSTR.search(s)
            if started and m:
                out.append((m.group(2), m.group(3)))
        else:
            if s.startswith("//") or s.startswith(".") or not s:
                continue
            m = _PTX_LABEL.match(s)
            if m:
                labels[m.group(1)] = len(out)
                continue
            m = _PTX_INSTR.match(s)
            if m:
                out.append((m.group(1), m.group(2)))
    return out, labels


def loops(instrs, labels):
    """``[(start, end)]`` index ranges of the innermost loops: a branch back to an earlier label closes one (a
    branch to itself, the trap after EXIT, is none)."""
    spans = []
    for i, (op, rest) in enumerate(instrs):
        if op.split(".")[0] not in ("BRA", "bra"):
            continue
        m = re.search(r"(\.L_x_\d+|\$L__BB\d+_\d+)", rest)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            spans.append((labels[m.group(1)], i))
    return [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]


def sass_class(op):
    base = op.split(".")[0]
    if base in ("LDG", "STG", "ATOMG", "REDG", "RED", "ATOM", "LDS", "STS", "LDSM", "BAR", "SHFL", "MUFU", "EXIT",
                "LDC", "ULDC"):
        return base
    if base[0] == "F" or base in ("HFMA2", "HADD2", "HMUL2", "DFMA", "DADD", "DMUL"):
        return "fp"
    if base in ("BRA", "BSSY", "BSYNC", "WARPSYNC", "NOP", "CALL", "RET"):
        return "control"
    return "int"


def _width(op):
    m = re.search(r"\.(128|64|U16|S16|U8|S8)\b", op)
    return {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}.get(m.group(1) if m else "", 4)


def _hist(ops):
    return dict(sorted(collections.Counter(ops).items()))


def analyse_sass(sass):
    """Loops (innermost, in order) with their instructions per trip by class and their global memory ops; what runs
    after the hot loop (the one loading the most bytes per trip) outside any loop."""
    ins, labels = instructions(sass, "sass")
    spans = loops(ins, labels)
    out = []
    for a, b in spans:
        body = [op for op, _ in ins[a:b + 1]]
        ldg = [op for op in body if op.startswith("LDG")]
        stg = [op for op in body if op.startswith("STG")]
        cls = collections.Counter(sass_class(op) for op in body)
        kind = ("load+reduce" if ldg and not stg and cls["SHFL"] else "load+store" if ldg and stg else
                "store only" if stg else "load only" if ldg else "other")
        out.append({"kind": kind, "instructions": len(body), "classes": dict(sorted(cls.items())),
                    "ldg": _hist(ldg), "stg": _hist(stg), "load_bytes": sum(map(_width, ldg)),
                    "store_bytes": sum(map(_width, stg)), "span": (a, b)})
    hot = max(out, key=lambda lp: (lp["load_bytes"], lp["instructions"]), default=None)
    in_loop = {i for lp in out for i in range(lp["span"][0], lp["span"][1] + 1)}
    start = hot["span"][1] + 1 if hot else 0
    after = [ins[i][0] for i in range(start, len(ins)) if i not in in_loop]
    mem = [op for op in after if op.split(".")[0] in ("LDG", "STG", "ATOMG", "REDG", "RED", "ATOM", "BAR", "SHFL")]
    return {"total": len(ins), "loops": out, "hot": out.index(hot) if hot else None,
            "after_hot": {"instructions": len(after), "ops": _hist(mem),
                          "loops_after": sum(1 for lp in out if lp["span"][0] >= start)}}


_HINT = re.compile(r"\.(L1::\w+|L2::\w+|nc|cg|cs|ca|lu|cv|wb|wt)\b")


def analyse_ptx(ptx):
    """Global loads / stores / atomics of the PTX by opcode (vector width, type, hints), inside the innermost loops and
    outside; the hints seen; ``bar.sync`` count."""
    ins, labels = instructions(ptx, "ptx")
    spans = loops(ins, labels)
    in_loop = {i for a, b in spans for i in range(a, b + 1)}

    def pick(pred):
        return (_hist(op for i, (op, _) in enumerate(ins) if pred(op) and i in in_loop),
                _hist(op for i, (op, _) in enumerate(ins) if pred(op) and i not in in_loop))
    loads = pick(lambda op: op.startswith("ld.global"))
    stores = pick(lambda op: op.startswith("st.global"))
    atomics = pick(lambda op: op.startswith(("atom.global", "red.global")))
    hints = sorted({h for op, _ in ins if op.startswith(("ld.global", "st.global")) for h in _HINT.findall(op)})
    return {"loads_in_loops": loads[0], "loads_outside": loads[1], "stores_in_loops": stores[0],
            "stores_outside": stores[1], "atomics": {**atomics[0], **atomics[1]}, "hints": hints,
            "bar_sync": sum(1 for op, _ in ins if op.startswith("bar.sync")),
            "cp_async": sum(1 for op, _ in ins if op.startswith("cp.async"))}


def occupancy(arch, regs, warps, shared):
    """Resident CTAs per SM (estimated): registers (allocated per warp in units of 256, split over 4 sub-partitions),
    threads, the 32-CTA limit, shared memory (plus the 1 KiB the driver reserves per CTA)."""
    reg_sm, thr_sm, cta_sm, smem_sm, reserved = LIMITS[arch]
    per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    warps_by_regs = (reg_sm // 4 // per_warp) * 4
    return min(warps_by_regs // warps, thr_sm // (32 * warps), cta_sm, smem_sm // (shared + reserved))


# ------------------------------------------------------------------------------------------ one arch, one V
_BLOCK = re.compile(r"^BLOCK")


def kernel_row(arch, N, V, name, grid, bound, kernel, asm_dir):
    md = kernel.metadata
    warps = md.num_warps
    res, sass = resources(kernel.asm["cubin"])
    shared = res.get("shared_static", 0) + md.shared
    blocks = {k: v for k, v in bound.items() if _BLOCK.match(k) and isinstance(v, int)}
    # elements a loop trip covers: a row kernel's BLOCK_V (its other blocks are its folded finalize's)
    elems = blocks["BLOCK_V"] if "BLOCK_V" in blocks else math.prod(blocks.values()) if blocks else None
    programs = grid[0] * grid[1] * grid[2]
    finalize = name.endswith("_finalize_kernel")
    # rows of the logits a program walks: the row kernels one each; a finalize program walks every [B, T] token
    rows_b = bound.get("B", 2 * bound["P"] if "P" in bound else None)
    row = {"arch": f"sm_{arch}", "V": V, "kernel": name, "grid": "x".join(map(str, grid)), "programs": programs,
           "rows_per_program": (f"all {rows_b}x{bound.get('T')} tokens" if finalize else round(N / programs, 3)),
           "num_warps": warps, "num_stages": md.num_stages, "block": blocks,
           "elements_per_thread_per_trip": None if elems is None else elems / (32 * warps),
           "trips_per_row": None if (elems is None or finalize) else math.ceil(V / elems),
           **res, "shared_dynamic": md.shared,
           "constexprs": {k: v for k, v in bound.items()
                          if isinstance(v, (bool, int, float, str)) and k not in blocks and not k.endswith(("_sb",
                                                                                                              "_st"))}}
    row["ctas_per_sm"] = occupancy(arch, res.get("registers", 0), warps, shared)
    row["warps_per_sm"] = row["ctas_per_sm"] * warps
    row["ptx"] = analyse_ptx(kernel.asm["ptx"])
    row["sass"] = analyse_sass(sass) if sass else None
    hot = row["sass"]["loops"][row["sass"]["hot"]] if row["sass"] and row["sass"]["hot"] is not None else None
    if hot and elems:
        per_thread = elems / (32 * warps)
        row["hot_loop"] = {
            "kind": hot["kind"], "sass_per_trip": hot["instructions"],
            "sass_per_element": round(hot["instructions"] / per_thread, 3),
            # with the masked lanes of the last trip: what a row of V elements costs per element
            "sass_per_element_of_row": (None if finalize else
                                        round(hot["instructions"] * row["trips_per_row"] * 32 * warps / V, 3)),
            "classes_per_trip": hot["classes"], "ldg_per_trip": hot["ldg"], "stg_per_trip": hot["stg"],
            "load_kib_in_flight_per_sm": round(hot["load_bytes"] * 32 * warps * row["ctas_per_sm"] / 1024, 1)}
    if asm_dir:
        stem = os.path.join(asm_dir, f"sm{arch}_V{V}_{name}_{hashlib.sha1(kernel.asm['ptx'].encode()).hexdigest()[:8]}")
        with open(stem + ".ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        if sass:
            with open(stem + ".sass", "w") as f:
                f.write(sass)
    return row


def run_arch(arch, N, vocabs, only, asm_dir):
    kernels, cases = {}, []
    for V in vocabs:
        calls = case_calls(N, V)
        for case, call in calls.items():
            if only and not any(s in case for s in only):
                continue
            launches = []
            counter = _aten_counter()
            with compiling(arch, launches):
                call()  # first: what a first call alone does (a workspace allocated once) is not counted
                launches.clear()
                with counter:
                    call()
            _say(f"sm_{arch} V={V} {case}: {len(launches)} Triton launches compiled")
            seq = []
            for name, grid, bound, kernel in launches:
                key = (V, name, grid, kernel.asm["ptx"])
                if key not in kernels:
                    kernels[key] = kernel_row(arch, N, V, name, grid, bound, kernel, asm_dir)
                    kernels[key]["used_by"] = []
                if case not in kernels[key]["used_by"]:
                    kernels[key]["used_by"].append(case)
                seq.append(f"{name}[{'x'.join(map(str, grid))}]")
            aten = dict(sorted(counter.ops.items()))
            cases.append({"arch": f"sm_{arch}", "V": V, "case": case, "triton_launches": seq,
                          "aten_kernels": aten, "device_launches": len(seq) + sum(aten.values())})
    return list(kernels.values()), cases


# ------------------------------------------------------------------------------------------ printing
def _fmt_hist(h):
    return ", ".join(f"{n}x {k}" for k, n in h.items()) or "-"


def print_kernel(r):
    hl = r.get("hot_loop") or {}
    s = r["sass"] or {}
    lines = [f"== {r['kernel']}  ({r['arch']}, V = {r['V']}; used by: {', '.join(r['used_by'])})",
             f"  launch        grid {r['grid']} = {r['programs']} programs, rows/program {r['rows_per_program']}, "
             f"num_warps {r['num_warps']}, num_stages {r['num_stages']}, blocks {r['block']}",
             f"  resources     {r.get('registers')} registers, stack {r.get('stack')} B, local {r.get('local')} B, "
             f"shared {r.get('shared_static')} B static + {r['shared_dynamic']} B dynamic; "
             f"est. {r['ctas_per_sm']} CTAs = {r['warps_per_sm']} warps per SM",
             f"  PTX loads     in loops: {_fmt_hist(r['ptx']['loads_in_loops'])}; "
             f"outside: {_fmt_hist(r['ptx']['loads_outside'])}",
             f"  PTX stores    in loops: {_fmt_hist(r['ptx']['stores_in_loops'])}; "
             f"outside: {_fmt_hist(r['ptx']['stores_outside'])}; atomics: {_fmt_hist(r['ptx']['atomics'])}",
             f"  hints         {', '.join(r['ptx']['hints']) or 'none'} (bar.sync {r['ptx']['bar_sync']}, "
             f"cp.async {r['ptx']['cp_async']})"]
    for i, lp in enumerate(s.get("loops", [])):
        mark = " (hot)" if i == s.get("hot") else ""
        lines.append(f"  SASS loop {i}{mark}  {lp['kind']}: {lp['instructions']} instr/trip "
                     f"{lp['classes']}; LDG {_fmt_hist(lp['ldg'])}; STG {_fmt_hist(lp['stg'])}")
    if hl:
        lines.append(f"  per element   {r['elements_per_thread_per_trip']:g} elements/thread/trip, "
                     f"{r['trips_per_row'] or '-'} trips/row: {hl['sass_per_element']} SASS instr/element "
                     f"({hl['sass_per_element_of_row']} with the row's masked tail); loads in flight "
                     f"{hl['load_kib_in_flight_per_sm']} KiB/SM per trip (est.)")
    if s:
        a = s["after_hot"]
        lines.append(f"  after hot     {a['instructions']} SASS instr outside loops, {_fmt_hist(a['ops'])}; "
                     f"{a['loops_after']} more loop(s) after it; {s['total']} instr in the kernel")
    print("\n".join(lines))


def summary(rows, cases):
    head = ("arch", "V", "kernel", "used by", "programs", "warps", "regs", "CTAs/SM", "elem/thr", "trips",
            "instr/trip", "instr/elem", "BAR/trip", "LDG/trip", "KiB in flight")
    table = [head]
    for r in rows:
        hl = r.get("hot_loop") or {}
        c = hl.get("classes_per_trip", {})
        used = ",".join(SHORT.get(u, u) for u in r["used_by"])
        table.append((r["arch"], r["V"], r["kernel"], used, r["programs"], r["num_warps"], r.get("registers"),
                      r["ctas_per_sm"], r["elements_per_thread_per_trip"], r["trips_per_row"] or "-",
                      hl.get("sass_per_trip", "-"), hl.get("sass_per_element_of_row") or hl.get("sass_per_element",
                                                                                                  "-"),
                      c.get("BAR", 0), _fmt_hist(hl.get("ldg_per_trip", {})), hl.get("load_kib_in_flight_per_sm",
                                                                                     "-")))
    w = [max(len(str(t[i])) for t in table) for i in range(len(head))]
    print()
    for t in table:
        print("  ".join(str(v).ljust(w[i]) for i, v in enumerate(t)))
    print()
    for c in cases:
        print(f"{c['arch']} V={c['V']} {c['case']}: {c['device_launches']} device launches = "
              f"{' + '.join(c['triton_launches'])}" + (f" + aten {c['aten_kernels']}" if c["aten_kernels"] else ""))


def _git():
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "humanline_kernels/ops"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return head, bool(dirty)
    except Exception:
        return None, None


def main(argv=None):
    p = Parser(prog="python -m bench.compare_compiled", description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, nargs="+", default=[90], choices=sorted(LIMITS), help="GPU archs (sm_XX)")
    p.add_argument("--vocab", type=int, nargs="+", default=[128256, 32000], help="vocabulary sizes")
    p.add_argument("--n", type=int, default=8192, help="tokens (even: DPO and KTO take two rows of N / 2)")
    p.add_argument("--only", nargs="+", default=None, help=f"cases whose name contains one of these: {CASES}")
    p.add_argument("--asm", default=None, help="also write each kernel's PTX and SASS into this directory")
    p.add_argument("--out", default=os.path.join("bench", "out"), help="output directory for the JSON")
    a = p.parse_args(argv)
    if a.n < 2 or a.n % 2:
        p.error(f"--n must be even and >= 2, got {a.n}")
    if any(v < 1 for v in a.vocab):
        p.error(f"--vocab must be positive, got {a.vocab}")
    if a.only and not any(s in c for s in a.only for c in CASES):
        p.error(f"--only {a.only} matches no case; cases: {', '.join(CASES)}")
    # before Triton is imported (nothing above imports it): Liger's @triton.jit kernels must be the compiled kind
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") == "1":
        p.error("triton was imported with TRITON_INTERPRET=1: Liger's kernels would be interpreted; unset it")
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton 3.9 warns when unset; 1 is its (and 3.6's) default
    import triton

    from bench import common
    for tool in ("cuobjdump", "nvdisasm"):
        if _tool(tool) is None:
            _say(f"{tool} is not in this triton wheel: registers and SASS columns are left empty")
    if a.asm:
        os.makedirs(a.asm, exist_ok=True)
    rows, cases = [], []
    for arch in a.arch:
        r, c = run_arch(arch, a.n, a.vocab, a.only, a.asm)
        rows += r
        cases += c
    for r in rows:
        print_kernel(r)
    summary(rows, cases)
    head, dirty = _git()
    ptxas = _run_tool("ptxas", "--version") or ""
    env = common.env_info()
    try:
        import importlib.metadata as md
        env["liger_kernel"] = md.version("liger-kernel")
    except Exception:
        pass
    meta = {"N": a.n, "vocabs": a.vocab, "archs": [f"sm_{x}" for x in a.arch], "dtype": "bfloat16",
            "triton": triton.__version__, "ptxas": (re.findall(r"V\d+\.\d+\.\d+", ptxas) or [None])[-1],
            "commit": head, "kernel_sources_modified": dirty,
            "what": "compiled, not launched: Triton's own specialisation on meta tensors, the wheel's ptxas"}
    for r in rows:
        for lp in (r["sass"] or {}).get("loops", []):
            lp.pop("span", None)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "compare_compiled.json")
    with open(path, "w") as f:
        json.dump({"env": env, "meta": meta, "kernels": rows, "cases": cases}, f, indent=1, default=str)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
