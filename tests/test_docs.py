"""The docs say what the code does (README.md and docs/*.md).

* Every ```python block runs, on tiny CPU shapes (the kernels through Triton's interpreter). The names a block takes
  from its page's prose (the reader's tensors, models, dataset) are given by :data:`GIVEN`, named in an HTML comment
  before the block, ``<!-- docs-test: given batch, models -->``; a block that cannot run here (a GPU, the network)
  says why, ``<!-- docs-test: skip (needs ...) -->``, and is skipped by that reason.
* Every call or signature written in prose, ``hk.losses.dpo(logps, ref_logps, mask, ...)``, names parameters the
  function has (in its order, where the call is a signature: it has ``*`` or ``...``), with the defaults it has;
  one with ``*`` and no ``...`` names them all.
* A span between ``<!-- docs-test: KIND ... -->`` and ``<!-- /docs-test -->`` is checked by kind, on the backticked
  names outside parentheses (``name`` or ``name=default``): ``keywords of F ...`` (each a keyword of those functions,
  with their default), ``all keywords of F ...`` (and every keyword of theirs listed), ``keywords A less B`` (the
  keywords module A's functions have and B's same-named ones lack), ``names MOD.ATTR ... [in order]`` (the elements
  of tuples or dicts in the code, e.g. bench e2e's arms; in a table, its first column), ``fields of CLASS`` (a table
  of a dataclass's fields and defaults), ``refusals`` (each refusal names its test, ``test_x`` or
  ``tests/file.py::test_x``, whose code, parametrisation included, names the refused option).
* Stated dtypes and launch counts are the code's; design.md's layout names every module; README's demo flags are the
  demo's; every file, ``file.py::name`` and environment variable the docs name exists.
"""
import ast
import copy
import glob
import importlib
import importlib.util
import inspect
import math
import os
import re

import pytest
import torch

import humanline_kernels as hk

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
DIRECTIVE = re.compile(r"<!-- docs-test: (.*?) -->", re.S)  # (may wrap onto the next lines)
SCOPE = re.compile(r"<!-- docs-test: ((?:names|keywords|all keywords|fields|refusals)\b[^>]*?) -->(.*?)"
                   r"<!-- /docs-test -->", re.S)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.M | re.S)
SCOPED = ("names ", "keywords of ", "all keywords of ", "keywords ", "fields of ", "refusals")


def _read(page):
    with open(os.path.join(ROOT, page), encoding="utf-8") as f:
        return f.read()


def _line(text, pos):
    return text.count("\n", 0, pos) + 1


# ------------------------------------------------------------------------------------------- what the blocks take
B, T, V, D = 2, 5, 64, 32  # one DPO pair (the interpreter's time grows with the rows); examples/tiny.py's V and D


def _tiny():
    spec = importlib.util.spec_from_file_location("hk_tiny", os.path.join(ROOT, "examples", "tiny.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _batch(tmp_path):
    """A padded batch of a DPO pair (or a desirable and an undesirable row), prompts masked, at the three levels."""
    g = torch.Generator().manual_seed(0)
    prompt = [1, 2]
    input_ids = torch.randint(3, V, (B, T + 1), generator=g)
    labels = input_ids[:, 1:].clone()
    for b, p in enumerate(prompt):
        labels[b, :p] = -100
    mask = labels != -100

    def logps():
        return (-torch.rand(B, T, generator=g) * 3) * mask

    weight = (torch.randn(V, D, generator=g) * 0.2).requires_grad_()
    lm_head = torch.nn.Linear(D, V, bias=False)
    return dict(torch=torch, hk=hk, input_ids=input_ids, labels=labels, mask=mask, logps=logps().requires_grad_(),
                ref_logps=logps(), kl_logps=logps(), kl_ref_logps=logps(), kl_mask=mask.clone(),
                desirable=torch.tensor([True, False]), advantages=torch.randn(B, generator=g),
                logits=torch.randn(B, T, V, generator=g, requires_grad=True),
                hidden=torch.randn(B, T, D, generator=g, requires_grad=True), weight=weight, lm_head=lm_head,
                ref_hidden=torch.randn(B, T, D, generator=g), ref_weight=weight.detach().clone(),
                ranges=[[p, T] for p in prompt])


def _packed(tmp_path):
    """The same kind of batch padding-free: 2 sequences end to end (the KL rows too), a range per sequence (in its
    own coordinates)."""
    g = torch.Generator().manual_seed(1)
    cu_seqlens, cu_kl, prompt = [0, 5, 8], [0, 4, 8], [1, 1]
    N = cu_seqlens[-1]
    labels = torch.randint(0, V, (1, N), generator=g)
    for s, p in enumerate(prompt):
        labels[0, cu_seqlens[s]:cu_seqlens[s] + p] = -100
    mask = labels != -100
    return dict(torch=torch, hk=hk, cu_seqlens=cu_seqlens, cu_kl=cu_kl, max_seqlen=5, labels=labels,
                mask=mask, logps=-torch.rand(1, N, generator=g) * mask, ref_logps=-torch.rand(1, N, generator=g) * mask,
                kl_logps=-torch.rand(1, N, generator=g), kl_ref_logps=-torch.rand(1, N, generator=g),
                kl_mask=torch.ones(1, N, dtype=torch.bool), desirable=torch.tensor([True, False]),
                advantages=torch.randn(2, generator=g), logits=torch.randn(1, N, V, generator=g, requires_grad=True),
                hidden=torch.randn(1, N, D, generator=g, requires_grad=True),
                weight=(torch.randn(V, D, generator=g) * 0.2).requires_grad_(),
                ranges=[[p, cu_seqlens[s + 1] - cu_seqlens[s]] for s, p in enumerate(prompt)])


def _models(tmp_path):
    """A tiny Llama policy, its reference (a copy), AdamW, and the reader's functions the loops call."""
    tiny = _tiny()
    policy = tiny.tiny_model()
    reference = copy.deepcopy(policy)
    batch = _batch(tmp_path)
    loader = [{"input_ids": batch["input_ids"], "labels": batch["labels"]}] * 2

    def logps_fn(model, batch):
        return hk.token_logprobs(model(batch["input_ids"]).logits[:, :-1], batch["labels"])

    def humanline_loss(model, batch, ref_logps):
        return hk.fused.dpo(model(batch["input_ids"]).logits[:, :-1], batch["labels"], ref_logps)[0]

    k = 1
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    return dict(batch, policy=policy, reference=reference, optimizer=torch.optim.AdamW(policy.parameters()),
                loader=loader, batches=loader, batch=loader[0], logps_fn=logps_fn,
                humanline_loss=humanline_loss, k=k, step=3, ckpt=str(ckpt),
                syncer=hk.ReferenceSyncer(policy, reference, every=k))


def _adapters(tmp_path):
    """A LoRA policy (PEFT) in place of the models."""
    peft = pytest.importorskip("peft")
    given = _models(tmp_path)
    peft_model = peft.get_peft_model(_tiny().tiny_model(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return dict(given, peft_model=peft_model,
                optimizer=torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad]))


def _trl(tmp_path, monkeypatch):
    """A saved tiny model (its path, as a hub id would be), its tokenizer and a preference dataset; without CUDA the
    configs get ``use_cpu=True``, as README says TRL needs there."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import TrainingArguments

    tiny = _tiny()
    tiny.quiet_trl_deprecations()
    path = str(tmp_path / "tiny")
    tiny.tiny_model().save_pretrained(path)
    tok = tiny.tiny_tokenizer()
    tok.save_pretrained(path)
    if not torch.cuda.is_available():
        post = TrainingArguments.__post_init__

        def on_cpu(self):
            self.use_cpu, self.report_to = True, []
            post(self)
        monkeypatch.setattr(TrainingArguments, "__post_init__", on_cpu)
    ds = Dataset.from_list([{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": f"{a + b + 1}!"}
                            for a in range(3) for b in range(2)])
    return dict(model=path, ref_model=tiny.tiny_model(), ds=ds, tok=tok, tokenizer=tok, k=2)


def _trainer(tmp_path, monkeypatch):
    """A plain transformers Trainer subclass (the reader's), its arguments and a tokenised dataset."""
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    given = _trl(tmp_path, monkeypatch)

    class MyTrainer(Trainer):
        pass

    ds = Dataset.from_list([{"input_ids": [3, 4, 5, 6], "labels": [3, 4, 5, 6]}] * 4)
    return dict(given, MyTrainer=MyTrainer, policy=_tiny().tiny_model(), ds=ds,
                args=TrainingArguments(output_dir=str(tmp_path / "out")))


def _lm_head(tmp_path):
    """A causal LM and a GRPO micro-batch for a head that computes the loss in the model's forward."""
    given = _batch(tmp_path)
    ids = given["input_ids"]
    completion_labels = ids.clone()
    completion_labels[:, :3] = -100
    return dict(given, lm=_tiny().tiny_model(), input_ids=ids, attention_mask=torch.ones_like(ids),
                completion_labels=completion_labels, ref_logps=-torch.rand(B, T))


GIVEN = {"batch": _batch, "packed batch": _packed, "models": _models, "adapters": _adapters, "trl": _trl,
         "trainer": _trainer, "lm head": _lm_head}


def _blocks():
    """``(page, line, code, directive)`` of every python block, the directive the comment right before it."""
    out = []
    for page in PAGES:
        text = _read(page)
        for m in FENCE.finditer(text):
            if m.group(1) != "python":
                continue
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            d = DIRECTIVE.fullmatch(before.strip())
            out.append((page, _line(text, m.start()), m.group(2), d.group(1) if d else None))
    return out


@pytest.mark.parametrize("page,line,code,directive", _blocks(), ids=[f"{p}:{n}" for p, n, _, _ in _blocks()])
def test_python_block_runs(page, line, code, directive, tmp_path, monkeypatch):
    given = {}
    if directive is not None:
        skip = re.fullmatch(r"skip \((needs .+)\)", directive)
        if skip:
            pytest.skip(f"{page}:{line}: {skip.group(1)}")
        names = re.fullmatch(r"given (.+)", directive)
        assert names, f"{page}:{line}: unknown directive {directive!r} (skip (needs ...) or given NAME, ...)"
        for name in (n.strip() for n in names.group(1).split(",")):
            assert name in GIVEN, f"{page}:{line}: nothing named {name!r} is given ({', '.join(GIVEN)})"
            builder = GIVEN[name]
            params = inspect.signature(builder).parameters
            given.update(builder(tmp_path, monkeypatch) if "monkeypatch" in params else builder(tmp_path))
    monkeypatch.chdir(tmp_path)  # (output_dir="out" and the like)
    exec(compile(code, f"{page}:{line}", "exec"), given)  # noqa: S102


def test_every_directive_is_known_and_every_scope_closed():
    for page in PAGES:
        text = _read(page)
        opened = [m for m in DIRECTIVE.finditer(text) if m.group(1).startswith(SCOPED)]
        assert len(opened) == text.count("<!-- /docs-test -->"), f"{page}: a docs-test scope is not closed"
        for m in DIRECTIVE.finditer(text):
            kind = " ".join(m.group(1).split())
            assert kind.startswith(SCOPED + ("skip (needs ", "given ")), f"{page}:{_line(text, m.start())}: {kind!r}"


# ----------------------------------------------------------------------------------- names in prose against code
def _prose(text):
    """The page without its fenced blocks (they run, above) and without HTML comments."""
    return re.sub(r"<!--.*?-->", "", FENCE.sub("", text), flags=re.S)


def _split(s, sep=","):
    """``s`` cut at ``sep`` outside brackets and quotes."""
    parts, depth, quote, cur = [], 0, None, ""
    for ch in s:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        cur += ch
    return parts + [cur.strip()]


def _top_spans(text):
    """The backticked spans of ``text`` outside parentheses (and HTML comments)."""
    out, depth, i = [], 0, 0
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    while i < len(text):
        ch = text[i]
        if ch == "`":
            j = text.index("`", i + 1)
            if depth == 0:
                out.append(" ".join(text[i + 1:j].split()))
            i = j + 1
            continue
        depth += ch == "("
        depth -= ch == ")"
        i += 1
    return out


def _top_names(text):
    """``[(name, default text or None)]`` of the backticked ``name`` / ``name=default`` outside parentheses."""
    out = []
    for span in _top_spans(text):
        for piece in _split(span):
            m = re.fullmatch(r"([A-Za-z_]\w*)(?:=(.+))?", piece)
            if m:
                out.append((m.group(1), m.group(2)))
    return out


def _resolve(dotted):
    """``hk.fused.dpo`` (or ``humanline_kernels...``, or a module attribute such as ``bench.bench_e2e.ARMS``);
    ``torch.ops.humanline``: the names of the custom ops the package registers."""
    if dotted == "torch.ops.humanline":
        for mod in ("logprobs", "token_terms", "dpo", "kto", "grpo", "sequence", "cluster"):
            importlib.import_module("humanline_kernels.ops." + mod)
        return sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("humanline::"))
    if dotted.startswith("hk."):
        obj = hk
        for part in dotted.split(".")[1:]:
            obj = getattr(obj, part)
        return obj
    mod, _, attr = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), attr)
    except ImportError:  # (verl's modules import verl, which has an environment of its own): read the literal
        with open(os.path.join(ROOT, *mod.split(".")) + ".py", encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == attr for t in node.targets):
                return ast.literal_eval(node.value)
        raise


def _value(text):
    try:
        return eval(text, {"hk": hk, "math": math, "torch": torch})  # noqa: S307 (our own docs)
    except Exception:  # a prose value ("a list", "512 MiB"): not compared
        return inspect.Parameter.empty


def _check_default(where, fn_name, param, text):
    want = _value(text)
    if want is inspect.Parameter.empty or text.strip() == "...":
        return
    assert param.default is not inspect.Parameter.empty, f"{where}: {fn_name}'s {param.name} has no default"
    assert param.default == want, f"{where}: {fn_name}'s {param.name} defaults to {param.default!r}, not {text}"


def _scopes():
    for page in PAGES:
        text = _read(page)
        for m in SCOPE.finditer(text):
            yield page, _line(text, m.start()), " ".join(m.group(1).split()), m.group(2)


def _scope_ids(kind):
    return [pytest.param(p, n, a, s, id=f"{p}:{n}") for p, n, a, s in _scopes() if a.startswith(kind)]


@pytest.mark.parametrize("page,line,arg,span", _scope_ids("names "))
def test_named_lists_are_the_codes(page, line, arg, span):
    m = re.fullmatch(r"names (.+?)( in order)?", arg)
    want = [x for attr in m.group(1).split() for x in _resolve(attr)]
    rows = _table(span)
    got = [n for row in rows for n, _ in _top_names(row[0])] if rows else [n for n, _ in _top_names(span)]
    if m.group(2):
        assert got == want, f"{page}:{line}: {got} are not {m.group(1)} {want}"
    else:
        assert sorted(got) == sorted(want), f"{page}:{line}: {got} are not {m.group(1)} {want}"


def _table(span):
    """The body rows of a markdown table in ``span``, as lists of cells (none: not a table)."""
    rows = [[c.strip() for c in ln.strip().strip("|").split(" | ")] for ln in span.splitlines() if ln.startswith("|")]
    return rows[2:]  # (the header and its rule)


@pytest.mark.parametrize("page,line,arg,span", _scope_ids("fields of "))
def test_field_tables_are_the_configs(page, line, arg, span):
    """A table of a dataclass's fields: the first column names every field (no other), the second its default."""
    import dataclasses
    cls = _resolve(arg.split(" of ", 1)[1])
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    listed = {}
    for row in _table(span):
        names = [n for n, _ in _top_names(row[0])]
        defaults = _split(row[1].replace("`", ""))
        assert len(defaults) == len(names), f"{page}:{line}: {row[0]} | {row[1]}: one default a field"
        listed.update(zip(names, defaults))
    assert set(listed) == set(fields), f"{page}:{line}: the table lists {sorted(listed)}, not {sorted(fields)}"
    for name, text in listed.items():
        assert _value(text) == fields[name], f"{page}:{line}: {name} defaults to {fields[name]!r}, not {text}"


def _keywords(fn):
    return {k: p for k, p in inspect.signature(fn).parameters.items() if p.kind == p.KEYWORD_ONLY}


@pytest.mark.parametrize("page,line,arg,span", _scope_ids("keywords of ") + _scope_ids("all keywords of "))
def test_keyword_lists_are_the_signatures(page, line, arg, span):
    where = f"{page}:{line}"
    names = arg.split(" of ", 1)[1].split()
    fns = {n: _resolve(n) for n in names}
    listed = _top_names(span)
    assert listed, f"{where}: no keyword listed"
    for name, default in listed:
        having = {n: _keywords(f)[name] for n, f in fns.items() if name in _keywords(f)}
        assert having, f"{where}: `{name}` is a keyword of none of {', '.join(names)}"
        if default is not None:
            for n, param in having.items():
                _check_default(where, n, param, default)
    if arg.startswith("all "):
        every = set().union(*(_keywords(f) for f in fns.values()))
        missing = every - {n for n, _ in listed}
        assert not missing, f"{where}: the list lacks {sorted(missing)}, keywords of {', '.join(names)}"


@pytest.mark.parametrize("page,line,arg,span", [s for s in _scope_ids("keywords ") if " less " in s.values[2]])
def test_keywords_one_module_lacks_are_listed(page, line, arg, span):
    a, b = (importlib.import_module("humanline_kernels." + m.split(".")[-1])
            for m in re.fullmatch(r"keywords (\S+) less (\S+)", arg).groups())
    lacking = set()
    for name, fn in inspect.getmembers(a, inspect.isfunction):
        other = getattr(b, name, None)
        if not name.startswith("_") and fn.__module__ == a.__name__ and callable(other):
            lacking |= set(_keywords(fn)) - set(_keywords(other))
    assert {n for n, _ in _top_names(span)} == lacking, f"{page}:{line}: {a.__name__} has {sorted(lacking)} beyond"


CALLABLE = re.compile(r"(hk(?:\.\w+)+|Humanline\w+|LookaheadReference|ReferenceSyncer)\((.*)\)", re.S)


def _namespace(name):
    if name.startswith("hk."):
        return _resolve(name)
    from humanline_kernels.integrations import transformers
    for ns in (hk, transformers):
        if hasattr(ns, name):
            return getattr(ns, name)
    trl = pytest.importorskip("humanline_kernels.integrations.trl")
    return getattr(trl, name)


def _calls():
    """Every backticked call of ours in prose: ``(where, dotted name, its argument text)``."""
    out = []
    for page in PAGES:
        text = _prose(_read(page))
        for m in re.finditer(r"`([^`]+?)`", text):  # (a span may wrap onto the next line)
            c = CALLABLE.fullmatch(" ".join(m.group(1).split()))
            if c:
                out.append((f"{page}:{_line(text, m.start())}", c.group(1), c.group(2)))
    return out


def test_calls_in_prose_name_real_parameters():
    checked = 0
    for where, name, args in _calls():
        fn = _namespace(name)
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())
        pieces = [p for p in _split(args) if p]
        signature = "*" in pieces or "..." in pieces  # a signature, not an example call
        if any(p.kind == p.VAR_KEYWORD for p in params):
            continue
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        lead = len(pieces)  # a signature's leading bare names are the function's positional parameters, in order
        for i, piece in enumerate(pieces):
            if piece in ("*", "...") or "=" in piece:
                lead = min(lead, i)
        for i, piece in enumerate(pieces):
            kw = re.fullmatch(r"(\w+)=(.+)", piece)
            if kw:
                assert kw.group(1) in sig.parameters, f"{where}: {name} has no parameter {kw.group(1)!r}"
                if signature:
                    _check_default(where, name, sig.parameters[kw.group(1)], kw.group(2))
            elif signature and i < lead and re.fullmatch(r"\w+", piece):
                assert i < len(positional) and positional[i].name == piece, (
                    f"{where}: {name}'s parameter {i + 1} is {positional[i].name if i < len(positional) else None!r}, "
                    f"not {piece!r}")
        if "*" in pieces and "..." not in pieces:
            listed = {re.match(r"\w+", p).group(0) for p in pieces if p != "*"}
            assert listed == set(sig.parameters), f"{where}: {name}{sig}, not ({args})"
        checked += 1
    assert checked >= 20, f"only {checked} calls found in the docs' prose: the pattern no longer sees them"


# ---------------------------------------------------------------------------------------- refusals and their tests
def _test_sources(name):
    """The source of each test called ``name`` (``test_x`` or ``tests/file.py::test_x``), with the module-level
    lists its decorators name (a parametrisation's cases)."""
    path, _, name = name.rpartition("::")
    paths = ([os.path.join(ROOT, path)] if path
             else glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True))
    out = []
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            src = f.read()
        if f"def {name}(" not in src:
            continue
        tree = ast.parse(src)
        assigned = {t.id: ast.get_source_segment(src, node) for node in tree.body if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Name)}
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == name:
                code = ast.get_source_segment(src, node)
                for dec in node.decorator_list:
                    code += ast.get_source_segment(src, dec)
                    code += "".join(assigned.get(n.id, "") for n in ast.walk(dec) if isinstance(n, ast.Name))
                out.append(code)
    return out


@pytest.mark.parametrize("page,line,arg,span", _scope_ids("refusals"))
def test_each_refusal_names_a_test_of_it(page, line, arg, span):
    items = re.split(r"\n\s*\* ", span) if "\n* " in "\n" + span.lstrip() else _split(span.replace(" and ", ", "))
    checked = 0
    for item in (i for i in items if i.strip()):
        named = [t for t in re.findall(r"`([^`]+)`", item) if re.fullmatch(r"(tests/[\w/]+\.py::)?test_\w+", t)]
        assert named, f"{page}:{line}: no test named for the refusal {item.strip()[:80]!r}"
        sources = ""
        for t in named:
            found = _test_sources(t)
            assert found, f"{page}:{line}: no test {t}"
            sources += "".join(found)
        for option in _top_spans(item):  # the refused options, outside the parentheses that explain them
            key = re.match(r"[\"']?(\w+)", option)
            assert key and re.search(rf"\b{key.group(1)}\b", sources), f"{page}:{line}: {named} do not name {option!r}"
            checked += 1
    assert checked, f"{page}:{line}: no refused option named"


# ------------------------------------------------------------------------------------------ dtypes, launch counts
def test_dtypes_are_as_the_docs_say():
    """Log-probs are fp32 for bf16/fp16/fp32 logits and fp64 for fp64 ones; a loss is in its reference log-probs'
    dtype (docs/design.md, "Returns"), at every level."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 3, 8, generator=g), torch.randint(0, 8, (2, 3), generator=g)
    h, w = torch.randn(2, 3, 4, generator=g), torch.randn(8, 4, generator=g)
    for dtype, want in ((torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                        (torch.float32, torch.float32), (torch.float64, torch.float64)):
        assert hk.token_logprobs(x.to(dtype), y).dtype == want, dtype
        if dtype != torch.float16:
            assert hk.fused_linear.token_logprobs(h.to(dtype), w.to(dtype), y).dtype == want, dtype
    mask, adv, des = y >= 0, torch.randn(2, generator=g), torch.tensor([True, False])
    for ref_dtype in (torch.float32, torch.float64):
        ref = -torch.rand(2, 3, generator=g, dtype=ref_dtype)
        losses = [hk.losses.dpo(ref - 0.1, ref, mask), hk.losses.kto(ref - 0.1, ref, mask, des),
                  hk.losses.grpo(ref - 0.1, ref, adv.to(ref_dtype), mask)]
        for logits_dtype in (torch.bfloat16, torch.float32, torch.float64):
            xl, hl, wl = x.to(logits_dtype), h.to(logits_dtype), w.to(logits_dtype)
            losses += [hk.fused.dpo(xl, y, ref), hk.fused.kto(xl, y, ref, des), hk.fused.grpo(xl, y, ref, adv),
                       hk.fused_linear.dpo(hl, wl, y, ref), hk.fused_linear.grpo(hl, wl, y, ref, adv)]
        for loss, metrics in losses:
            assert loss.dim() == 0 and loss.dtype == ref_dtype
            assert all(v.dim() == 0 and not v.requires_grad for v in metrics.values())


def test_design_states_the_fused_linear_launch_counts_the_launch_test_holds():
    """docs/design.md's Host bullet: ``4 per chunk + 5`` for GRPO at any chunk count and one-chunk DPO/KTO, ``8``
    (DPO) and ``6`` (KTO) ``per chunk + 4`` with several chunks, as tests/ops/test_launch_budget.py's budgets and
    ceilings have them."""
    spec = importlib.util.spec_from_file_location("hk_launch_budget", os.path.join(ROOT, "tests", "ops",
                                                                                   "test_launch_budget.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    calls = mod._calls()
    held = {name: ceiling or budget for name, (_, _, budget, ceiling) in calls.items()}
    assert held["fused_linear.grpo"] == held["fused_linear.dpo"] == held["fused_linear.kto"] == 4 + 5
    assert held["fused_linear.grpo(4 chunks)"] == 4 * 4 + 5
    assert held["fused_linear.dpo(2 chunks)"] == 8 * 2 + 4 and held["fused_linear.kto(4 chunks)"] == 6 * 4 + 4
    host = re.search(r"\* \*\*Host:\*\*(.*?)\n\* ", _read("docs/design.md"), re.S).group(1)
    host = " ".join(host.split())
    assert "4 per chunk + 5 for GRPO at any number of chunks and for DPO and KTO in one chunk" in host
    assert "DPO launches 8 and KTO 6 per chunk + 4" in host


def test_verl_config_in_the_docs_is_the_config_class():
    """docs/verl.md's config (its YAML and its command-line overrides) sets only fields HumanlinePolicyLossConfig
    has (read from its source: verl, which it subclasses, has an environment of its own)."""
    yaml = pytest.importorskip("yaml")
    path = os.path.join(ROOT, "humanline_kernels", "integrations", "verl", "_config.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "HumanlinePolicyLossConfig")
    fields = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)} | {"_target_"}
    text = _read("docs/verl.md")
    blocks = {kind: [b for k, b in FENCE.findall(text) if k == kind] for kind in ("yaml", "bash")}
    (config,) = [yaml.safe_load(b) for b in blocks["yaml"]]
    in_yaml = set(config["actor_rollout_ref"]["actor"]["policy_loss"])
    in_bash = set(re.findall(r"actor_rollout_ref\.actor\.policy_loss\.(\w+)=", "".join(blocks["bash"])))
    assert in_yaml and in_bash and in_yaml | in_bash <= fields, sorted((in_yaml | in_bash) - fields)
    assert in_yaml == fields, f"docs/verl.md's YAML lacks {sorted(fields - in_yaml)}"


def test_design_layout_names_every_module():
    """docs/design.md's layout names every module and folder of the package, and every module of ops/."""
    text = _read("docs/design.md")
    layout = next(b for k, b in FENCE.findall(text) if b.startswith("humanline_kernels/"))
    pkg = os.path.join(ROOT, "humanline_kernels")
    entries = [os.path.relpath(os.path.join(d, e), pkg) for d in (pkg, os.path.join(pkg, "ops"))
               for e in os.listdir(d) if e not in ("__init__.py", "__main__.py", "__pycache__")]
    for entry in entries:
        name = os.path.basename(entry)
        assert re.search(rf"(?<![\w.]){re.escape(name)}\b", layout), f"docs/design.md's layout does not name {entry}"


def test_readme_names_the_demos_flags():
    """README's flag list is the demo's parser: each flag it lists exists, and every flag is named in README."""
    from humanline_kernels.demo import cli
    flags = {o for a in cli.parser()._actions for o in a.option_strings if o.startswith("--")}
    text = _read("README.md")
    listed = set(re.findall(r"`(--[a-z][a-z-]*)", text[text.index("Flags ("):text.index("A bad flag")]))
    assert listed and listed <= flags, sorted(listed - flags)
    assert flags <= set(re.findall(r"(--[a-z][a-z-]*)", text)), sorted(flags - set(re.findall(r"--[a-z-]+", text)))


PATH = re.compile(r"(?<![\w/.-])((?:tests|tools|examples|bench|humanline_kernels|csrc|docs|ops|integrations|sync)/"
                  r"[\w./-]*\w)(?:::(\w+))?")


def test_files_and_functions_the_docs_name_exist():
    """Every path the docs name (from the project's root, or inside the package: ``ops/...``) exists, and a
    ``file.py::name`` names a function or class of that file. ``bench/out`` is where the benchmarks write."""
    for page in PAGES:
        text = _read(page)
        for m in PATH.finditer(text):
            path, name = m.group(1), m.group(2)
            if path.startswith("bench/out") or text[m.end():m.end() + 1] == "-":  # (a name cut at a line's end)
                continue
            found = [c for c in (path, os.path.join("humanline_kernels", path))
                     if os.path.exists(os.path.join(ROOT, c))]
            assert found, f"{page}:{_line(text, m.start())}: no {path}"
            if name and os.path.isfile(os.path.join(ROOT, found[0])):
                src = _read(found[0])
                assert re.search(rf"^\s*(?:def|class) {name}\b|^{name} = ", src, re.M), (
                    f"{page}:{_line(text, m.start())}: {found[0]} has no {name}")


def test_environment_variables_the_docs_name_are_read():
    """An ``HK_*`` / ``HUMANLINE_*`` variable the docs name is read somewhere in the code (a removed switch leaves no
    instruction behind)."""
    code = ""
    for pattern in ("humanline_kernels/**/*.py", "bench/*.py", "tests/**/*.py", "tools/*.py", "setup.py"):
        for path in glob.glob(os.path.join(ROOT, pattern), recursive=True):
            if not path.endswith("test_docs.py"):
                code += _read(os.path.relpath(path, ROOT))
    for page in PAGES:
        for var in sorted(set(re.findall(r"\b(?:HK|HUMANLINE)_[A-Z0-9_]+\b", _read(page)))):
            assert f'"{var}"' in code, f"{page} names {var}, which no code reads"


def test_grpo_table_has_every_grpo_config_field():
    """docs/integrations.md's "every `GRPOConfig` field" table: its first column names each field TRL's GRPOConfig adds
    to TrainingArguments, and no other (our own fields are the "(ours)" row)."""
    import dataclasses
    trl = pytest.importorskip("trl")
    from transformers import TrainingArguments
    text = _read("docs/integrations.md")
    part = text[text.index("### GRPO: every `GRPOConfig` field"):text.index("### DPO and KTO")]
    listed = {n for row in _table(part) if not row[0].startswith("(ours)") for n, _ in _top_names(row[0])}
    base = {f.name for f in dataclasses.fields(TrainingArguments)}
    fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)} - base
    assert listed == fields, f"missing {sorted(fields - listed)}, not fields {sorted(listed - fields)}"
