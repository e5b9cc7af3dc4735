"""GRPO's gradient in the forward on the thread-block cluster kernel (ops/cluster.py, ops/gif_cluster.cu).

On CPU: the dispatch (which device, card, dtype and vocabulary choose it; the table; ``forced``), the rows it takes,
the loader's error without NVRTC, and the path around the kernel (the weights launch, the planes, the fold's
reduction in a launch of its own, the packed batch's finalize, autograd) end to end against ``hk.reference`` with a
stand-in for the CUDA launch (the Triton row kernel writing the same planes and gradient). On an sm_90 GPU: the
kernel itself against ``hk.reference`` (every loss type, clip on and off, temperature, the KL reference, advantages
per token, packed batches, in place, each dtype and cluster size), deterministic, in a CUDA graph; elsewhere the
Triton kernel runs. The compile for sm_90a (registers, spills): tests/ops/test_gif_cluster_compile.py.
"""
import contextlib
import warnings

import pytest
import torch
from test_fused_losses import _data, _run

import humanline_kernels as hk
from humanline_kernels.ops import _jit, _nvrtc, cluster, tuning
from humanline_kernels.ops import token_terms as TK

HAS_CUDA = torch.cuda.is_available()
SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
CARD = "NVIDIA H200"


@pytest.fixture
def table():
    """Set the tuned table for a test (restored after)."""
    yield tuning.set_table
    tuning.set_table(None)


@pytest.fixture
def on(monkeypatch):
    """Device types the cluster path may take, for a test: ``on("meta")`` (dispatch only), ``on("cpu")`` (with the
    stand-in launch, see :func:`stand_in`); the card is named ``CARD`` there."""
    added = []

    def put(*types):
        added.extend(t for t in types if t not in cluster.DEVICES)
        cluster.DEVICES.update(types)  # (in place: fused.py reads the same set through ops.kernels)
        monkeypatch.setattr(tuning, "device_name", lambda d: CARD)
    yield put
    cluster.DEVICES.difference_update(added)


def meta(V, dtype=torch.bfloat16, B=2, T=8):
    return torch.empty((B, T, V), dtype=dtype, device="meta")


# ------------------------------------------------------------------------------------------- dispatch (CPU)
def test_cpu_and_meta_tensors_take_triton_by_default():
    with cluster.forced(4, 256):
        assert cluster.config(meta(128256), None) is None
        assert cluster.config(torch.zeros(2, 3, 128), None) is None


@pytest.mark.parametrize("cap,ok", [((9, 0), True), ((8, 0), False), ((8, 9), False), ((10, 0), False),
                                    ((12, 0), False)])
def test_only_sm90_devices_run_it(monkeypatch, cap, ok):
    monkeypatch.setattr(cluster, "_capability", lambda d: cap)
    assert cluster.arch_ok(torch.device("cuda", 0)) is ok


def test_table_decides_by_card_dtype_and_vocabulary(on, table):
    on("meta")
    table({"grad_in_forward": {CARD: {"bf16": {"128256": [4, 256], "32000": [2, 512]}}}})
    assert cluster.config(meta(128256), None) == (4, 256)
    assert cluster.config(meta(151936), None) == (4, 256)  # the nearest tabled size within a factor of 2
    assert cluster.config(meta(32000), None) == (2, 512)
    assert cluster.config(meta(262144 * 2), None) is None  # beyond a factor of 2 of every entry
    assert cluster.config(meta(128256, torch.float16), None) is None  # no fp16 entry
    table({"grad_in_forward": {"another card": {"bf16": {"128256": [4, 256]}}}})
    assert cluster.config(meta(128256), None) is None


def test_empty_table_keeps_triton(on, table):
    """The shipped table has no cluster entry (none measured yet): forced or nothing."""
    on("meta")
    table(None)
    assert not [e for per in tuning.table().get("grad_in_forward", {}).values() for per_v in per.values()
                for e in per_v.values() if isinstance(e, list)]
    assert cluster.config(meta(128256), None) is None
    with cluster.forced(4, 256):
        assert cluster.config(meta(128256), None) == (4, 256)


@pytest.mark.parametrize("entry", [[3, 256], [4, 100], [4], "4x256", None, [4, 256, 1]])
def test_malformed_entries_are_ignored(on, table, entry):
    on("meta")
    table({"grad_in_forward": {CARD: {"bf16": {"128256": entry}}}})
    assert cluster.config(meta(128256), None) is None


def test_forced_checks_its_arguments_and_nests():
    with pytest.raises(ValueError, match="ctas"):
        with cluster.forced(3, 256):
            pass
    with pytest.raises(ValueError, match="threads"):
        with cluster.forced(4, 100):
            pass
    assert cluster.forced_config() is None
    with cluster.forced(4, 256):
        with cluster.forced(8, 512):
            assert cluster.forced_config() == (8, 512)
        assert cluster.forced_config() == (4, 256)
    assert cluster.forced_config() is None


@pytest.mark.parametrize("V,dtype,ctas,ok", [
    (128256, torch.bfloat16, 2, True), (151936, torch.bfloat16, 2, True), (32000, torch.bfloat16, 1, True),
    (50257, torch.bfloat16, 4, False),  # rows not 16-byte vectors
    (151936, torch.float32, 2, False), (151936, torch.float32, 4, True),  # 607,744 B a row: 4 slices fit, 2 do not
    (262144, torch.bfloat16, 2, False), (262144, torch.bfloat16, 4, True),
    (16, torch.bfloat16, 8, True),  # tiny rows: empty slices do nothing
    (128256, torch.float64, 4, False)])
def test_rows_it_takes(V, dtype, ctas, ok):
    assert cluster.fits(meta(V, dtype), None, ctas) is ok


def test_rows_it_takes_need_rows_16_bytes_apart():
    x = torch.zeros(2, 5, 136, dtype=torch.bfloat16)
    assert cluster.fits(x, None, 4) and cluster.fits(x[:, :-1], None, 4) and cluster.fits(x, x, 4)
    assert not cluster.fits(torch.zeros(2, 5, 132, dtype=torch.bfloat16)[..., :128], None, 4)  # rows 264 B apart
    assert not cluster.fits(x, torch.zeros(2, 5, 140, dtype=torch.bfloat16)[..., :136], 4)  # the gradient's rows
    assert not cluster.fits(x[:, :0], None, 4)  # no rows
    # a pointer off 16 bytes (only real tensors have one: under torch.compile the launcher checks it)
    assert cluster.fits(x[..., 1:129], None, 4)


def test_rows_off_16_bytes_take_the_triton_row_kernel_in_the_launcher(monkeypatch):
    """A pointer that is not 16-byte aligned reaches the launcher only under torch.compile (``fits`` sees fake
    tensors there): it writes the same planes and gradient with Triton's row kernel instead of the CUDA one."""
    x, y, ref = _data(2, 4, 136, torch.bfloat16, seed=6)
    logits = x[..., 1:129]  # 2 bytes past 16
    assert logits.data_ptr() % 16
    adv, w = torch.tensor([1.0, -0.5]), torch.tensor([0.125, 0.25])
    outs = []
    for launch in (cluster._grpo_cluster_out.fn, TK._token_terms_out.fn):
        planes = [torch.zeros(2, 4) for _ in range(3)] + [torch.zeros(5, 2, 4)]
        grad = torch.zeros(logits.shape, dtype=logits.dtype)
        kw = dict(logits=logits[:, :-1], labels=y.clamp(max=127), ref=ref, kl_ref=None, advantages=adv,
                  row_weight=w, grad=grad[:, :-1], grad_inplace=False, val=planes[0], coef=planes[1],
                  lse=planes[2], aux=planes[3], tok=None, clip=True, log_eps_p=-1.5, log_eps_r=1.5, ratio_low=0.8,
                  ratio_high=1.2, beta=0.04, inv_temperature=1.0, ignore_index=-100)
        if launch is cluster._grpo_cluster_out.fn:
            launch(**kw, ctas=4, threads=256)
        else:
            launch(**kw, terms=2, n0=8, off0=0, off1=0)
        outs.append((planes, grad))
    for a, b in zip(outs[0][0] + [outs[0][1]], outs[1][0] + [outs[1][1]]):
        assert torch.equal(a, b)
    assert outs[0][1].abs().sum() > 0


@pytest.mark.parametrize("V,es,ctas", [(128256, 2, 4), (151936, 2, 8), (32000, 2, 2), (100, 4, 8), (16, 2, 8),
                                       (8, 2, 1), (151936, 4, 4)])
def test_slices_cover_the_row_in_16_byte_units(V, es, ctas):
    s = cluster.slice_elements(V, es, ctas)
    assert (s * es) % 16 == 0 and s * ctas >= V and (s - 16 // es) * ctas < V


def test_params_mirror_the_kernel_struct():
    """Every field of the CUDA struct, in order and of its type, in the ctypes mirror (with the size, which the
    compile checks, that fixes every offset; nvcc checks each offset too)."""
    text = open(cluster.SOURCE).read()
    body = text[text.index("struct Params {"):text.index("};", text.index("struct Params {"))]
    ctype = {"void*": "c_void_p", "hk_i64*": "c_void_p", "float*": "c_void_p", "hk_i64": "c_long", "int": "c_int",
             "float": "c_float"}
    fields = []
    for line in body.splitlines()[1:]:
        decl = line.split("//")[0].strip().rstrip(";").replace("const ", "")
        if decl:
            kind, names = decl.split(" ", 1)
            star = "*" if names.lstrip().startswith("*") else ""
            fields += [(n.strip().lstrip("*"), ctype[kind + star]) for n in names.split(",")]
    assert fields == [(n, t.__name__) for n, t in cluster.Params._fields_]
    src = cluster.source((0, 4, 256))
    assert src.count("static_assert(__builtin_offsetof(Params,") == len(fields)
    assert src.rstrip().endswith("HK_GIF_CLUSTER(0, 4, 256)")


# ------------------------------------------------------------------------------------------- the loader (CPU)
def test_missing_nvrtc_is_named(monkeypatch):
    monkeypatch.setattr(_nvrtc, "candidates", lambda major=None: ["/nonexistent/nvidia/cu99/lib/libnvrtc.so.99"])
    with pytest.raises(_nvrtc.NvrtcNotFound) as e:
        _nvrtc.load_nvrtc(major=99)
    msg = str(e.value)
    assert "libnvrtc.so.99" in msg and "/nonexistent/nvidia/cu99/lib/libnvrtc.so.99" in msg
    assert "pip install nvidia-cuda-nvrtc" in msg and "CUDA build of torch" in msg
    assert "nvidia-cuda-nvrtc-cu12" in _nvrtc.not_found_message(12, [])


def test_missing_nvrtc_warns_once_and_keeps_triton(monkeypatch):
    def missing(*a, **k):
        raise _nvrtc.NvrtcNotFound("NVRTC was not found.")
    monkeypatch.setattr(_nvrtc, "load_nvrtc", missing)
    monkeypatch.setattr(cluster, "_WARNED", [])
    with pytest.warns(RuntimeWarning, match="Triton kernel runs instead"):
        assert cluster._nvrtc_ok() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cluster._nvrtc_ok() is False  # once


def test_forced_launch_without_nvrtc_raises(monkeypatch):
    """A forced configuration does not fall back: the first launch asks the loader, which raises."""
    def missing(*a, **k):
        raise _nvrtc.NvrtcNotFound("NVRTC was not found.")
    monkeypatch.setattr(_nvrtc, "load_nvrtc", missing)
    monkeypatch.setattr(cluster, "_CUBINS", {})
    with pytest.raises(_nvrtc.NvrtcNotFound):
        cluster.cubin(0, 4, 256)


def test_candidates_look_in_the_nvidia_wheels(monkeypatch, tmp_path):
    for sub, name in (("cu13", "libnvrtc.so.13"), ("cu13", "libnvrtc.alt.so.13"), ("cuda_nvrtc", "libnvrtc.so.12"),
                      ("cu13", "libnvrtc-builtins.so.13.0")):
        (tmp_path / "nvidia" / sub / "lib").mkdir(parents=True, exist_ok=True)
        (tmp_path / "nvidia" / sub / "lib" / name).write_bytes(b"")

    class Spec:
        submodule_search_locations = [str(tmp_path / "nvidia")]
    monkeypatch.setattr(_nvrtc.importlib.util, "find_spec", lambda name: Spec() if name == "nvidia" else None)
    names = [p.split("nvidia/")[1] for p in _nvrtc.candidates()]
    assert names == ["cu13/lib/libnvrtc.so.13", "cuda_nvrtc/lib/libnvrtc.so.12"]
    assert [p.split("nvidia/")[1] for p in _nvrtc.candidates(12)] == ["cuda_nvrtc/lib/libnvrtc.so.12"]


# ------------------------------------------------------------------------------------------- the path around it (CPU)
def stand_in(calls):
    """The cluster op's contract with Triton's row kernel behind it (interpreted): the same planes and gradient."""
    def launch(**kw):
        calls.append((kw.pop("ctas"), kw.pop("threads")))
        _jit.LAUNCHES[("compiled", "gif_cluster")] += 1  # as the launcher counts its launch
        tok = kw.pop("tok")
        rows = kw["labels"].numel()
        TK._token_terms_launch(**kw, terms=2, n0=rows if tok is None else 0, off0=0, off1=0, tok=tok)
        if kw["grad_inplace"]:
            torch.autograd.graph.increment_version(kw["logits"])
    return launch


@pytest.fixture
def cpu_cluster(on, monkeypatch):
    """CPU tensors may take the cluster path, its launch the stand-in; yields the stand-in's calls."""
    on("cpu")
    calls = []
    monkeypatch.setattr(cluster, "_grpo_cluster_out", stand_in(calls))
    monkeypatch.setattr(cluster, "_grpo_cluster_inplace", stand_in(calls))
    _jit.LAUNCHES.clear()
    yield calls


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo", "grpo", "dr_grpo"])
@pytest.mark.parametrize("clip", [hk.HumanlineClip(), None], ids=["clip", "noclip"])
def test_path_around_the_kernel_matches_the_reference(cpu_cluster, loss_type, clip):
    x, y, ref = _data(4, 9, 136, seed=3)  # 9 tokens a row: several of the interpreter's 4-token tiles
    adv = torch.tensor([1.0, -0.5, 0.7, 2.0])
    kw = dict(loss_type=loss_type, beta=0.05, clip=clip, grad_in_forward=True)
    if loss_type == "dr_grpo":
        kw["max_completion_length"] = 12
    with cluster.forced(4, 256):
        _run("grpo", x, y, ref, (adv,), kw, upstream=1.0 if loss_type != "grpo" else 2.5)
    assert cpu_cluster and all(c == (4, 256) for c in cpu_cluster)
    kernels = {k for _, k in _jit.LAUNCHES}
    assert "_grpo_fold_finalize_kernel" in kernels and "_grpo_finalize_kernel" in kernels  # reduction; weights
    assert "_grpo_loss_kernel" not in kernels


def test_gpu_parity_stage_runs_its_cluster_rows_on_the_cluster_kernel(cpu_cluster):
    """``bench gpu``'s cluster rows (code a GPU session runs unseen) reach the cluster kernel through the parity
    stage's own forcing of the Triton kernel for the other grad_in_forward rows, and match the reference."""
    from bench import bench_gpu
    rows = bench_gpu.parity(N=64, V=56, D=16, device="cpu", only=["cluster"])
    assert len(rows) == 12 and all("cluster" in r["case"] for r in rows)  # 4 loss types and in place, x 2; packed
    assert not [r for r in rows if not r["ok"]]
    assert len(cpu_cluster) == 12 and set(cpu_cluster) == {(4, 256)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_path_options(cpu_cluster, dtype):
    x, y, ref = _data(3, 6, 200, dtype, seed=1)
    kl_ref = ref + 0.1 * torch.randn(ref.shape)
    adv = torch.randn(3, 6)  # per token
    kw = dict(beta=0.1, kl_ref_logps=kl_ref, temperature=0.8, epsilon_high=0.28, grad_in_forward=True)
    with cluster.forced(2, 512):
        _run("grpo", x, y, ref, (adv,), dict(kw, normalizer=7.0))
        _run("grpo", x, y, ref, (adv,), dict(kw, inplace_backward=True), upstream=-3.0)
    assert cpu_cluster == [(2, 512)] * 2


def test_path_packed(cpu_cluster):
    """A packed batch: the token map into the kernel, the finalize launch after it; the same loss and gradient
    as the padded batch on the Triton path."""
    S, T, V = 3, 7, 128
    lens = [7, 4, 6]
    x, y, ref = _data(S, T, V, seed=5)
    x = x[:, :-1].contiguous()
    y[:, :] = torch.where(torch.arange(T) < torch.tensor(lens)[:, None], y.clamp(min=0), -100)
    adv = torch.tensor([0.3, -1.0, 2.0])
    cu = [0, 7, 11, 17]
    xp = torch.cat([x[i, :n] for i, n in enumerate(lens)])
    yp, rp = (torch.cat([t[i, :n] for i, n in enumerate(lens)]) for t in (y, ref))
    kw = dict(beta=0.04, grad_in_forward=True, clip=hk.HumanlineClip())
    leaf = xp.clone().requires_grad_()
    with cluster.forced(4, 256):
        loss, m = hk.fused.grpo(leaf, yp, rp, adv, packed=hk.Packed(cu), **kw)
    loss.backward()
    assert cpu_cluster
    assert ("interpreted", "_grpo_finalize_kernel") in _jit.LAUNCHES  # the packed batch's reduction
    lp = x.clone().requires_grad_()  # the padded batch on the Triton path
    loss_p, m_p = hk.fused.grpo(lp, y, ref, adv, **kw)
    loss_p.backward()
    torch.testing.assert_close(loss, loss_p, atol=1e-5, rtol=1e-5)
    for k in m_p:
        torch.testing.assert_close(m[k], m_p[k], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(leaf.grad, torch.cat([lp.grad[i, :n] for i, n in enumerate(lens)]), atol=1e-6,
                               rtol=1e-5)


def test_path_keeps_triton_where_rows_do_not_fit(cpu_cluster):
    x, y, ref = _data(2, 4, 130, seed=2)  # 130 fp32 elements: rows not 16-byte vectors
    with cluster.forced(4, 256):
        _run("grpo", x, y, ref, (torch.tensor([1.0, -1.0]),), dict(grad_in_forward=True))
    assert not cpu_cluster and ("interpreted", "_grpo_loss_kernel") in _jit.LAUNCHES


def test_forward_only_and_no_grad_take_no_gradient_path(cpu_cluster):
    x, y, ref = _data(2, 4, 128, seed=2)
    with torch.no_grad(), cluster.forced(4, 256):
        hk.fused.grpo(x[:, :-1], y, ref, torch.tensor([1.0, -1.0]), grad_in_forward=True)
    assert not cpu_cluster


# ------------------------------------------------------------------------------------------- the kernel (GPU)
def _cuda(B, T, V, dtype, seed=0):
    x, y, ref = _data(B, T, V, dtype, seed=seed)
    return x.cuda(), y.cuda(), ref.cuda()


def _ran_cluster(launches):
    return launches[("compiled", "gif_cluster")] > 0


need_sm90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU (H100, H200)")

GPU_CASES = [dict(loss_type=t, beta=0.04) for t in ("dapo", "bnpo", "grpo")] + [
    dict(loss_type="dr_grpo", max_completion_length=40), dict(loss_type="bnpo", normalizer=30.5),
    dict(loss_type="dapo", inplace_backward=True), dict(loss_type="dapo", kl_ref_logps="shifted", beta=0.1),
    dict(loss_type="grpo", temperature=0.7, epsilon_high=0.28)]


@pytest.mark.gpu
@need_sm90
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("clip", [hk.HumanlineClip(-1.5, 1.5), None], ids=["clip", "noclip"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_kernel_matches_reference(case, clip, dtype, compiled_kernels):
    x, y, ref = _cuda(4, 37, 3008, dtype)
    adv = torch.tensor([1.0, -0.5, 0.7, 2.0], device="cuda")
    kw = dict(case, clip=clip, grad_in_forward=True)
    if kw.get("kl_ref_logps") == "shifted":
        kw["kl_ref_logps"] = ref - 0.2
    with cluster.forced(4, 256):
        _run("grpo", x, y, ref, (adv,), kw, upstream=1.0 if case.get("loss_type") != "grpo" else 2.5)
    assert _ran_cluster(compiled_kernels)


@pytest.mark.gpu
@need_sm90
@pytest.mark.parametrize("ctas,threads", [(1, 512), (2, 256), (2, 512), (4, 256), (4, 512), (8, 256), (8, 128)])
@pytest.mark.parametrize("V", [32000, 128256, 151936, 40])
def test_kernel_cluster_sizes_and_vocabularies(ctas, threads, V, compiled_kernels):
    """The label in every slice (first and last columns too), an all-ignored row, advantages per token."""
    if not cluster.fits(torch.empty(1, 1, V, dtype=torch.bfloat16, device="meta"), None, ctas):
        pytest.skip("the slice does not fit in shared memory")
    x, y, ref = _cuda(3, 11, V, torch.bfloat16, seed=ctas)
    y[0, :3] = torch.tensor([0, V - 1, V // 2], device="cuda")
    adv = torch.randn(3, 11, device="cuda")
    with cluster.forced(ctas, threads):
        _run("grpo", x, y, ref, (adv,), dict(grad_in_forward=True, beta=0.04, clip=hk.HumanlineClip()))
    assert _ran_cluster(compiled_kernels)


@pytest.mark.gpu
@need_sm90
@pytest.mark.parametrize("device_cu", [False, True], ids=["host cu", "device cu"])
def test_kernel_packed(device_cu, compiled_kernels):
    S, T, V = 3, 33, 4096
    lens = [33, 20, 27]
    x, y, ref = _cuda(S, T, V, torch.bfloat16, seed=4)
    x = x[:, :-1].contiguous()
    adv = torch.tensor([0.3, -1.0, 2.0], device="cuda")
    cu = [0, 33, 53, 80]
    xp = torch.cat([x[i, :n] for i, n in enumerate(lens)])
    yp, rp = (torch.cat([t[i, :n] for i, n in enumerate(lens)]) for t in (y, ref))
    packed = hk.Packed(torch.tensor(cu, device="cuda"), max(lens)) if device_cu else hk.Packed(cu)
    out = {}
    for path in ("cluster", "triton"):
        leaf = xp.clone().requires_grad_()
        with cluster.forced(4, 256) if path == "cluster" else contextlib.nullcontext():
            loss, m = hk.fused.grpo(leaf, yp, rp, adv, beta=0.04, grad_in_forward=True, packed=packed)
        loss.backward()
        out[path] = (loss, m, leaf.grad)
    (lc, mc, gc), (lt, mt, gt) = out["cluster"], out["triton"]
    torch.testing.assert_close(lc, lt, atol=2e-4, rtol=1e-4)
    for k in mt:
        torch.testing.assert_close(mc[k], mt[k], atol=1e-4, rtol=1e-4)
    assert ((gc.float() - gt.float()).norm() / gt.float().norm()).item() < 1e-2
    assert _ran_cluster(compiled_kernels)


@pytest.mark.gpu
@need_sm90
def test_kernel_is_deterministic_and_level_with_triton(compiled_kernels):
    x, y, ref = _cuda(8, 64, 128256, torch.bfloat16, seed=7)
    x = x[:, :-1]
    adv = torch.randn(8, device="cuda")
    runs = []
    for path in ("cluster", "cluster", "triton"):
        leaf = x.detach().clone().requires_grad_()
        with cluster.forced(4, 256) if path == "cluster" else contextlib.nullcontext():
            loss, m = hk.fused.grpo(leaf, y, ref, adv, beta=0.04, grad_in_forward=True)
        runs.append((loss, m, torch.autograd.grad(loss, leaf)[0]))
    (l1, m1, g1), (l2, m2, g2), (lt, mt, gt) = runs
    assert torch.equal(l1, l2) and torch.equal(g1, g2) and all(torch.equal(m1[k], m2[k]) for k in m1)
    torch.testing.assert_close(l1, lt, atol=1e-4, rtol=1e-4)
    assert ((g1.float() - gt.float()).norm() / gt.float().norm()).item() < 1e-2


@pytest.mark.gpu
@need_sm90
def test_kernel_captures_in_a_cuda_graph(compiled_kernels):
    x, y, ref = _cuda(4, 37, 4096, torch.bfloat16, seed=8)
    adv = torch.randn(4, device="cuda")
    leaf = x.detach().clone().requires_grad_()

    def step():
        loss, _ = hk.fused.grpo(leaf[:, :-1], y, ref, adv, beta=0.04, grad_in_forward=True)
        return loss, torch.autograd.grad(loss, leaf)[0]
    with cluster.forced(4, 256):
        eager = step()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static[0], eager[0]) and torch.equal(static[1], eager[1])
    assert _ran_cluster(compiled_kernels)


@pytest.mark.gpu
def test_other_rows_and_devices_keep_triton(compiled_kernels):
    """Rows that are not 16-byte vectors (V = 3001), and any device but sm_90: the Triton kernel, forced or not."""
    x, y, ref = _cuda(4, 9, 3001, torch.bfloat16, seed=9)
    with cluster.forced(4, 256):
        _run("grpo", x, y, ref, (torch.randn(4, device="cuda"),), dict(grad_in_forward=True))
    assert not _ran_cluster(compiled_kernels)
    if not SM90:
        x, y, ref = _cuda(4, 9, 4096, torch.bfloat16, seed=9)
        with cluster.forced(4, 256):
            _run("grpo", x, y, ref, (torch.randn(4, device="cuda"),), dict(grad_in_forward=True))
        assert not _ran_cluster(compiled_kernels)
