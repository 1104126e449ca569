"""Export a compiled cell to one module file and a JSON sidecar; load it with the TVM runtime alone.

    halstm.export(f, "lstm.so")            # writes lstm.so and lstm.so.json
    g = halstm.load("lstm.so")             # TVM_USE_RUNTIME_LIB=1 is enough: no compiler library
    y, states = g(x, params)

A module is code: loading it runs what it holds, with your rights. Load only modules you exported
yourself or got from someone you trust. The checks below catch damaged files, mix-ups and modules
this host cannot run, not an attacker, who can rewrite the sidecar too.

The sidecar records the module file's size and SHA-256, the cell (name and hash of its lowered
expressions), the calling signature (state and output names, shapes, dtype), the target (kind, key,
the host code's LLVM triple, -mcpu, -mattr and the instruction-set extensions they enable; for CUDA
also the GPU architecture and instruction set), the recipe and knobs, and the halstm and TVM
versions. ``load`` checks, before it opens the module, every sidecar field and its type, the file's
size and SHA-256, both versions against this process, the CPU architecture and extensions (Linux's
/proc/cpuinfo) and, for CUDA, the GPU's architecture against this host, and the ``cell``,
``steps``, ``batch`` and ``dtype`` the caller passes; then the argument names, shapes and dtypes
against the module's own. A refusal is a ``ModuleRefused`` naming the file, what differs, what was
expected and what was found.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.metadata
import itertools
import json
import os
import platform
import re
from pathlib import Path

import tvm
import tvm_ffi

from .runtime import STEPS, SequenceFunction, Signature, check_dimension

FORMAT = 3

# The instruction-set extensions compiled code may use, by LLVM's name (what the sidecar records),
# with Linux's name for each in /proc/cpuinfo (x86 "flags", AArch64 "Features").
CPU_FEATURES = {
    "sse": "sse", "sse2": "sse2", "sse3": "pni", "ssse3": "ssse3", "sse4.1": "sse4_1", "sse4.2": "sse4_2",
    "sse4a": "sse4a", "avx": "avx", "avx2": "avx2", "fma": "fma", "fma4": "fma4", "xop": "xop",
    "f16c": "f16c", "bmi": "bmi1", "bmi2": "bmi2", "lzcnt": "abm", "popcnt": "popcnt", "movbe": "movbe",
    "avx512f": "avx512f", "avx512cd": "avx512cd", "avx512bw": "avx512bw", "avx512dq": "avx512dq",
    "avx512vl": "avx512vl", "avx512ifma": "avx512ifma", "avx512vbmi": "avx512vbmi",
    "avx512vbmi2": "avx512_vbmi2", "avx512vnni": "avx512_vnni", "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq", "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16",
    "avxvnni": "avx_vnni", "gfni": "gfni",
    "neon": "asimd", "fp-armv8": "fp", "fullfp16": "fphp", "dotprod": "asimddp", "sve": "sve",
    "sve2": "sve2", "bf16": "bf16", "i8mm": "i8mm",
}
CPUINFO = Path("/proc/cpuinfo")

# What each sidecar field holds: a type, [type] for a list of them, or a dict of fields.
_TARGET = {"kind": str, "key": str, "triple": str, "mcpu": str, "mattr": [str], "features": [str]}
_TARGETS = {"cpu": _TARGET, "cuda": {**_TARGET, "arch": str, "isa": str}}
_SCHEMA = {
    "format": int, "size": int, "sha256": str, "cell": str, "cell_hash": str, "halstm": str, "tvm": str,
    "signature": {"cell": str, "states": [str], "output": str, "input_size": int, "hidden_size": int,
                  "steps": (int, type(None)), "batch": int, "dtype": str, "longest": (int, type(None)),
                  "args": [{"name": str, "shape": [(int, list, str)], "dtype": str, "role": str,
                            "extra_steps": (int, type(None))}]},
    "target": dict, "recipe": str, "knobs": dict, "allow_tf32": bool,
}


class ModuleRefused(ValueError):
    """``load`` refuses a module: the message names the file, what differs, expected and found."""


class LoadedCell(SequenceFunction):
    """An exported sequence function, loaded; ``meta`` is its sidecar."""

    def __init__(self, main, signature: Signature, device, meta: dict):
        super().__init__(main, signature, device)
        self.meta = meta

    def __repr__(self):
        s = self.signature
        return f"<loaded {s.cell} T={s.steps or 'any'} B={s.batch} {s.dtype} for {self.meta['target']['key']}>"


def sidecar(path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def export(compiled, path) -> Path:
    """Write ``compiled``'s module to ``path`` (a shared library) and its metadata beside it, each
    file replaced whole (a reader never sees a partial one)."""
    from .lowering import cell_hash

    path = Path(path).expanduser()
    _write_atomically(path, lambda tmp: compiled.module.export_library(str(tmp)))
    meta = {
        "format": FORMAT,
        "size": path.stat().st_size,
        "sha256": _sha256(path),
        "cell": compiled.cell.name,
        "cell_hash": cell_hash(compiled.cell),
        "halstm": _halstm_version(),
        "tvm": tvm.__version__,
        "signature": compiled.signature.to_json(),
        "target": _target_meta(compiled.target),
        "recipe": compiled.recipe.name,
        "knobs": compiled.knobs,
        "allow_tf32": compiled.program.allow_tf32,
    }
    _write_atomically(sidecar(path), lambda tmp: tmp.write_text(json.dumps(meta, indent=1) + "\n"))
    return path


def _target_meta(target) -> dict:
    """The sidecar's ``target``: for the host code (the whole module on the CPU), LLVM's triple,
    -mcpu and -mattr, and the extensions of CPU_FEATURES they enable, which the host must have."""
    from tvm.target import codegen

    host = target.tvm_target.host or target.tvm_target
    meta = {
        "kind": target.kind,
        "key": target.key,
        "triple": str(host.attrs.get("mtriple") or codegen.llvm_get_system_triple()),
        "mcpu": str(host.attrs.get("mcpu", "")),
        "mattr": [str(a) for a in host.attrs.get("mattr", [])],
        "features": sorted(set(codegen.llvm_get_cpu_features(host)) & CPU_FEATURES.keys()),
    }
    if target.kind == "cuda":
        meta |= {"arch": target.arch, "isa": target.isa}
    return meta


def _write_atomically(path: Path, write) -> None:
    """``write(tmp)`` to a temporary file beside ``path``, then rename it to ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_meta(path) -> dict:
    """The sidecar of the module at ``path``, refused unless every field is there with its type."""
    meta_path = sidecar(path)
    if not meta_path.exists():
        raise FileNotFoundError(f"{meta_path} is missing: export writes it beside the module")
    try:
        meta = json.loads(meta_path.read_text())
    except ValueError as error:  # also UnicodeDecodeError
        raise ModuleRefused(f"{meta_path}: not a JSON sidecar ({error})") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        raise ModuleRefused(f"{meta_path}: format: expected {FORMAT}, found {found!r}; export the module again")
    _conform(meta, _SCHEMA, "", meta_path)
    kind = meta["target"]["kind"]
    if kind not in _TARGETS:
        raise ModuleRefused(f"{meta_path}: target.kind: expected one of {sorted(_TARGETS)}, found {kind!r}")
    _conform(meta["target"], _TARGETS[kind], "target", meta_path)
    return meta


def _conform(value, schema, field: str, where: Path) -> None:
    """Refuse ``value`` unless it has ``schema``'s form (see _SCHEMA); ``field`` names it."""
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise ModuleRefused(f"{where}: {field}: expected an object, found {value!r}")
        missing, unknown = schema.keys() - value.keys(), value.keys() - schema.keys()
        if missing or unknown:
            raise ModuleRefused(f"{where}: {field or 'the sidecar'}: expected the fields {sorted(schema)}, "
                                f"found {sorted(missing)} missing and {sorted(unknown)} unknown")
        for key, sub in schema.items():
            _conform(value[key], sub, f"{field}.{key}" if field else key, where)
    elif isinstance(schema, list):
        if not isinstance(value, list):
            raise ModuleRefused(f"{where}: {field}: expected a list, found {value!r}")
        for i, item in enumerate(value):
            _conform(item, schema[0], f"{field}[{i}]", where)
    elif not isinstance(value, schema) or (isinstance(value, bool) and schema is not bool):
        names = " or ".join(t.__name__ for t in (schema if isinstance(schema, tuple) else (schema,)))
        raise ModuleRefused(f"{where}: {field}: expected {names}, found {value!r}")


def load(path, *, cell=None, steps: int | None = None, batch: int | None = None,
         dtype: str | None = None) -> LoadedCell:
    """Load the module exported to ``path`` (a bare name or relative path is taken from the current
    directory; ``~`` is expanded). ``cell``, ``steps``, ``batch``, ``dtype``, when given, must match
    the export (``cell`` by name, states, output and hash, which needs the compiler library)."""
    path = Path(path).expanduser().absolute()
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing")
    meta = read_meta(path)
    signature = Signature.from_json(meta["signature"])
    _check_signature(sidecar(path), signature)
    _check_file(path, meta)
    for what, recorded, running in (("halstm version", meta["halstm"], _halstm_version()),
                                    ("TVM version", meta["tvm"], tvm.__version__)):
        if recorded != running:
            raise ModuleRefused(f"{path}: {what}: expected {recorded} (the export's), found {running} "
                                "(this process); export the module again with this one")
    for name, want in (("steps", steps), ("batch", batch), ("dtype", dtype)):
        have = getattr(signature, name)
        if want is not None and want != have:
            raise ModuleRefused(f"{path} was compiled for {name}={have}, not {want}")
    if cell is not None:
        _check_cell(path, meta, cell)
    _check_cpu(path, meta["target"])
    device = _device(path, meta["target"])
    if meta["target"]["kind"] == "cuda":
        _compile_kernels_for(meta["target"]["isa"])
    main = tvm_ffi.load_module(str(path))["main"]
    _check_arguments(path, signature, main)
    return LoadedCell(main, signature, device, meta)


def _check_signature(where: Path, signature: Signature) -> None:
    """The sidecar's argument names as the runtime reads them: x, then ``<state>0`` each state's
    initial value, ``<state>_seq`` its sequence, the parameters the rest."""
    if signature.output not in signature.states:
        raise ModuleRefused(f"{where}: signature.output: expected one of the states {list(signature.states)}, "
                            f"found {signature.output!r}")
    expected = {"x": ["x"], "state": [s + "0" for s in signature.states],
                "param": [a.name for a in signature.args if a.role == "param"],
                "output": [s + "_seq" for s in signature.states]}
    if signature.steps is None:
        expected["steps"] = [STEPS]
    found = {role: [a.name for a in signature.args if a.role == role]  # the scratch buffers: any names, last
             for role in expected.keys() | {a.role for a in signature.args} - {"scratch"}}
    if found != expected:
        raise ModuleRefused(f"{where}: signature.args by role: expected {expected}, found {found}")
    any_steps = signature.steps is None
    if any_steps != (signature.longest is not None) or (any_steps and signature.longest < 1):
        raise ModuleRefused(f"{where}: signature.longest: expected a positive int where steps is null (any T), "
                            f"null otherwise; found steps {signature.steps!r}, longest {signature.longest!r}")
    sequences = {"x": 0, **{s + "_seq": 1 for s in signature.states}} if any_steps else {}
    scratch_from = len(signature.args) - sum(a.role == "scratch" for a in signature.args)
    for i, a in enumerate(signature.args):
        if (a.role == "scratch") != (i >= scratch_from):
            raise ModuleRefused(f"{where}: signature.args {a.name}: the scratch buffers come last")
        try:
            for d in a.shape:
                check_dimension(d, any_steps and a.role == "scratch")
        except ValueError as error:
            raise ModuleRefused(f"{where}: signature.args {a.name}: shape: {error}") from None
        if a.extra_steps != sequences.get(a.name):
            raise ModuleRefused(f"{where}: signature.args {a.name}: extra_steps: expected "
                                f"{sequences.get(a.name)!r}, found {a.extra_steps!r}")


def _check_file(path: Path, meta: dict) -> None:
    """The module file is the one exported: same size and SHA-256 (read before it is opened:
    the dynamic loader crashes the process on a truncated library)."""
    size = path.stat().st_size
    if size != meta["size"]:
        raise ModuleRefused(f"{path}: size: expected {meta['size']} bytes (the sidecar's), found {size}; "
                            "the file was truncated or changed after export")
    digest = _sha256(path)
    if digest != meta["sha256"]:
        raise ModuleRefused(f"{path}: SHA-256: expected {meta['sha256']} (the sidecar's), found {digest}; "
                            "the file was changed after export")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _halstm_version() -> str:
    return importlib.metadata.version("halstm")


def _check_cell(path: Path, meta: dict, cell) -> None:
    """The caller's cell is the exported one: name, states, output and the hash of its lowered step."""
    from .lowering import cell_hash

    signature = meta["signature"]
    for what, recorded, given in (("cell", meta["cell"], cell.name),
                                  ("states", signature["states"], list(cell.states)),
                                  ("output", signature["output"], cell.output),
                                  ("cell hash", meta["cell_hash"], cell_hash(cell))):
        if recorded != given:
            raise ModuleRefused(f"{path}: {what}: expected {given!r} (the cell given), "
                                f"found {recorded!r} (the sidecar's)")


def _check_cpu(path: Path, target: dict) -> None:
    """This host runs the module's host code: its architecture and CPU extensions."""
    machine = _machine(target["triple"].split("-")[0])
    if machine != _machine(platform.machine()):
        raise ModuleRefused(f"{path}: CPU architecture: expected {machine} (target.triple "
                            f"{target['triple']}), found {_machine(platform.machine())} (this host)")
    missing = sorted(set(target["features"]) - _host_cpu_features())
    if missing:
        flags = f"-mcpu={target['mcpu'] or 'generic'}" + "".join(f" -mattr={a}" for a in target["mattr"])
        raise ModuleRefused(f"{path}: CPU features: expected {sorted(target['features'])} (compiled for "
                            f"{flags}), found {missing} absent on this host")


def _machine(name: str) -> str:
    """One name per architecture: Python's, LLVM's and the kernel's differ."""
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name.lower(), name.lower())


def _host_cpu_features() -> set[str]:
    """The extensions of CPU_FEATURES this host has: from /proc/cpuinfo, or where there is none, from
    LLVM's model of the host CPU (which needs the compiler library)."""
    if not CPUINFO.exists():
        from tvm.target import codegen

        host = tvm.target.Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu()})
        return set(codegen.llvm_get_cpu_features(host)) & CPU_FEATURES.keys()
    for line in CPUINFO.read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(value.split())
            return {llvm for llvm, linux in CPU_FEATURES.items() if linux in flags}
    return set()


_TENSOR_ARG = re.compile(r"(\w+): Tensor\(\[([\d, ]*)\], (\w+)\)")


def _check_arguments(path: Path, signature: Signature, main) -> None:
    """The sidecar's arguments are the module's: ``main`` called without any raises an error that
    lists its own, ``name: Tensor([shape], dtype)`` each. Skipped where it lists them otherwise."""
    try:
        main()
    except TypeError as error:
        text = str(error)
    else:
        return
    count = re.search(r"Expected (\d+) arguments", text)
    module_args = [(name, tuple(int(d) for d in shape.split(",") if d.strip()), dtype)
                   for name, shape, dtype in _TENSOR_ARG.findall(text)]
    if count is None or int(count.group(1)) != len(module_args):
        return
    sidecar_args = [(a.name, tuple(a.shape), a.dtype) for a in signature.args]
    for i, (expected, found) in enumerate(itertools.zip_longest(module_args, sidecar_args)):
        if expected != found:
            raise ModuleRefused(f"{path}: argument {i} (name, shape, dtype): expected {expected} (the module's), "
                                f"found {found} (the sidecar's)")


def _device(path: Path, target: dict):
    if target["kind"] == "cpu":
        return tvm.cpu(0)
    device = _cuda_device()
    arch = f"sm_{device.compute_version.replace('.', '')}"
    if target["arch"] != arch:
        raise ModuleRefused(f"{path}: GPU architecture: expected {target['arch']} ({target['key']}), "
                            f"found {arch} (this GPU)")
    return device


def _compile_kernels_for(arch: str) -> None:
    """An exported CUDA module holds CUDA source (TVM 0.27 stores format 'cuda'), compiled with
    NVRTC when it loads. TVM's own hook asks the compiler library for the current target's
    architecture; this one takes the instruction set the module was built for from the sidecar
    (sm_90a where its kernels use wgmma, which sm_90 lacks), so the runtime alone suffices."""
    from tvm.support import nvcc

    def compile_cuda(code):
        return nvcc.compile_cuda(code, target_format="cubin", arch=arch, compiler="nvrtc")

    tvm_ffi.register_global_func("tvm_callback_cuda_compile", compile_cuda, override=True)


def _cuda_device():
    """The GPU, with TVM's CUDA runtime loaded: the runtime-only package does not load it itself."""
    device = tvm.cuda(0)
    if not device.exist:
        lib = Path(tvm.__file__).parent / "lib" / "libtvm_runtime_cuda.so"
        if lib.exists() and os.environ.get("TVM_USE_RUNTIME_LIB"):
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            device = tvm.cuda(0)
    if not device.exist:
        raise RuntimeError("the module is compiled for CUDA, but no CUDA device is visible")
    return device
