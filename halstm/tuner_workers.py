"""The tuner's worker processes: each candidate compiled, checked against the float64 reference
and timed in a process of its own, so that one that crashes, hangs or corrupts memory costs a
restart, not the tuning run.

A worker is a Python process (``_BOOT``, then ``_serve``) that runs the jobs sent on its stdin: a
candidate's build (compiled and exported), its measurement (loaded, checked, median of prepared
calls) or a runoff (candidates timed side by side). ``measure_jobs`` spreads a round's jobs over
compile workers and measuring workers, one a GPU. Jobs travel with cloudpickle, so cells defined in
a script's ``__main__`` or a notebook travel by value.
"""

from __future__ import annotations

import hashlib
import os
import select
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import cloudpickle
import numpy as np

from .bench import alternating_median_ms, median_ms
from .database import candidate_id

TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}
TF32_TOLERANCE = 1e-2  # float32 with allow_tf32: 10 mantissa bits as fp16 has
# A message on a worker's pipes: a tag, then the length of the cloudpickle that follows. An answer is
# a few numbers or one error line: a longer one, or one without the tag, is not an answer.
_HEADER = struct.Struct("<4sQ")
_TAG = b"HLSM"
_ANSWER_LIMIT = 1 << 20
_READY = "ready"  # a worker's first message, once it has imported the compiler (``_serve``)
_BOOT_LIMIT = 300  # seconds a worker may take to say it is ready before its first job's time starts anyway
# The worker's first lines, before it imports anything: '' (its working folder under -c) leaves the
# import path, and its answers go on a copy of fd 1, fd 1 itself then writing to stderr, so that
# nothing printed (by Python, or a C library writing to fd 1) can corrupt them.
_BOOT = ("import os, sys; sys.path[:] = [p for p in sys.path if p]; answers = os.dup(1); os.dup2(2, 1); "
         "from halstm.tuner_workers import _serve; _serve(answers, cuda={cuda})")


@dataclass
class Job:
    """One candidate: the problem, its recipe and knobs, the inputs and the float64 output it is checked
    against, and the calls it is timed over."""

    cell: object
    steps: int
    batch: int
    dtype: str
    target: object
    recipe: object  # a Recipe
    knobs: dict
    inputs: tuple  # x, params, states
    expected: np.ndarray  # float64 output sequence
    repeat: int
    allow_tf32: bool = False
    module: str | None = None  # where the candidate's exported module is (or goes, to build it)


def build(job: Job) -> tuple[None, None]:
    """Compile one candidate and export it to ``job.module``."""
    from .deploy import export

    export(_compile(job), job.module)
    return None, None


def _compile(job: Job):
    from .compiler import compile as compile_cell

    return compile_cell(job.cell, job.steps, job.batch, job.dtype, job.target, job.recipe, job.knobs,
                        allow_tf32=job.allow_tf32)


def _load(job: Job):
    """The candidate, loaded from ``job.module`` where it was built there, else compiled here."""
    from .deploy import load

    return load(job.module) if job.module else _compile(job)


def measure(job: Job) -> tuple[float | None, str | None]:
    """Check and time one candidate: (median ms, None) or (None, why it failed)."""
    f = _load(job)
    x, params, states = job.inputs
    y, _ = f(x, params, states)
    y = np.asarray(y, dtype=np.float64)
    error = float(np.linalg.norm(y - job.expected) / np.linalg.norm(job.expected))
    if not error < (TF32_TOLERANCE if job.allow_tf32 else TOLERANCE[job.dtype]):
        return None, f"wrong result: relative error {error:.2e}"
    return median_ms(f.prepare(x, params, states), job.repeat), None  # a prepared call waits for the device


def runoff(jobs: list[Job]) -> tuple[list[float], None]:
    """Time candidates already checked side by side, one call of each in turn, so that the drift of
    the device's clocks and the machine's load falls on all alike: ([median ms], None)."""
    calls = {i: _load(job).prepare(*job.inputs) for i, job in enumerate(jobs)}
    ms = alternating_median_ms(calls, lambda: None, 2, jobs[0].repeat)  # a prepared call waits for the device
    return [ms[i] for i in calls], None


class Worker:
    """A Python process (``_BOOT``, then ``_serve``) that builds or measures the candidates sent on its
    stdin; restarted when one hangs or kills it. Jobs travel with cloudpickle, so cells defined in a
    script's ``__main__`` or a notebook travel by value."""

    def __init__(self, gpu: str | None = None, cuda: bool = False, env: dict | None = None):
        self.gpu = gpu  # the worker's one visible GPU (a CUDA_VISIBLE_DEVICES entry); None: the parent's GPUs
        self.cuda = cuda  # it measures CUDA candidates: it loads CUDA as it starts
        self.env = env or {}  # more of its environment
        self._start()

    def _start(self):
        # the parent's import path (its absolute entries), as multiprocessing's spawn passes it:
        # halstm and classes pickled by reference (a cell or recipe in a test module, say) import as
        # they did there. It runs in a folder of its own: a shared one such as /tmp, first on the
        # path under `-m`, lets anyone plant a module (cloudpickle.py) that the worker would run.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if os.path.isabs(p)),
               "HALSTM_CACHE": "0", **self.env}  # candidates are measured once: none goes into the module cache
        if self.gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.gpu
        self.folder = tempfile.mkdtemp(prefix="halstm-worker-")
        self.process = subprocess.Popen([sys.executable, "-c", _BOOT.format(cuda=self.cuda)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, env=env, cwd=self.folder)
        self.booted = False

    def run(self, job, timeout: float, phase: str = "measure"):
        """Run ``phase`` of ``job``: its answer, or why it failed."""
        self.send(job, phase)
        return self.answer(timeout)

    def send(self, job, phase: str) -> None:
        """Start ``phase`` ("measure", "build", or "runoff" of a list of jobs) of ``job``; ``answer``
        waits for it. The job's time starts once the worker has imported the compiler (it says so
        first, ``_READY``), which took 6.6-8.2 s on the 2-core CPU machine alone (``python -c "from
        halstm import compiler, deploy"``) and more under load, where a candidate that compiles in
        seconds then timed out at 30 s. While it waits, the other workers' answers wait too."""
        if not self.booted:
            try:
                if select.select([self.process.stdout], [], [], _BOOT_LIMIT)[0]:
                    self.booted = _receive(self.process.stdout, _ANSWER_LIMIT) == _READY
            except (EOFError, OSError, ValueError):
                pass  # a worker that died, said something else or did not start: answer() reports it
        self.started = time.monotonic()
        try:
            _send(self.process.stdin, (phase, job))
        except OSError:
            pass  # a dead worker: answer() reports it

    def answer(self, timeout: float):
        """The answer to the job sent, or a failure if it hangs past ``timeout``, kills the worker or
        answers something else (the worker is then restarted)."""
        try:
            left = max(0.0, self.started + timeout - time.monotonic())
            ready, _, _ = select.select([self.process.stdout], [], [], left)
            if ready:
                return _receive(self.process.stdout, _ANSWER_LIMIT)
            reason = f"timed out after {timeout:.0f} s"
        except ValueError as e:
            reason = f"the worker's answer was malformed ({e})"
        except (EOFError, OSError):  # its pipe closed: wait for the exit code (poll() raced the exit)
            try:
                code = self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                code = None
            reason = f"the worker died (exit code {code})"
        self.close()
        self._start()
        return None, reason

    def close(self):
        self.process.kill()
        self.process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


def _send(stream, value) -> None:
    data = cloudpickle.dumps(value)
    stream.write(_HEADER.pack(_TAG, len(data)) + data)
    stream.flush()


def _receive(stream, limit: int | None = None):
    """The next value on ``stream``: EOFError where it ends first, ValueError where what comes is
    not a message of at most ``limit`` bytes."""
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise EOFError
    tag, size = _HEADER.unpack(head)
    if tag != _TAG:
        raise ValueError(f"expected a header starting {_TAG!r}, got {head!r}")
    if limit is not None and size > limit:
        raise ValueError(f"{size} bytes announced, more than {limit}")
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return cloudpickle.loads(data)


def _serve(answers: int, cuda: bool = False) -> None:
    """The worker's loop: build or measure each job read from stdin, answer (ms, None) or
    (None, why) on the file descriptor ``answers``. It first imports the compiler and, with
    ``cuda``, creates its GPU's CUDA context: while the tuner's process computes the reference and
    the first round compiles, not on the first candidate."""
    stdin, stdout = sys.stdin.buffer, os.fdopen(answers, "wb")
    sys.stdout = sys.stderr  # Python's prints unbuffered, in order with the rest (fd 1 is stderr's)
    from . import compiler, deploy  # noqa: F401
    if cuda:
        _create_cuda_context()
    _send(stdout, _READY)
    while True:
        try:
            phase, job = _receive(stdin)
        except EOFError:
            return
        try:
            answer = {"build": build, "measure": measure, "runoff": runoff}[phase](job)
        except Exception as e:  # a candidate that does not compile or launch: recorded, skipped
            last = (str(e).strip().splitlines() or [""])[-1]
            answer = (None, f"{type(e).__name__}: {last[:300]}")
        _send(stdout, answer)


def _create_cuda_context() -> None:
    import tvm

    try:
        device = tvm.cuda(0)
        if device.exist:
            tvm.runtime.empty((1,), "float32", device)
    except Exception:  # noqa: BLE001 -- the first candidate's measurement reports what is wrong
        pass


def module_path(folder: str, job: Job) -> str:
    """Where a candidate's module goes in ``folder``: one file a candidate."""
    return os.path.join(folder, hashlib.sha1(candidate_id(job.recipe.name, job.knobs).encode()).hexdigest() + ".so")


def measure_jobs(jobs: list[Job], measurers: list[Worker], builders: list[Worker], timeout: float, log, folder: str,
             overlap: bool):
    """(job, ms, error, the measuring worker's GPU or None) for each job, as each is measured:
    compiled first into ``folder`` by the ``builders`` (where there are any), then checked and
    timed by a free one of the ``measurers`` (one a GPU; of those free, the one that has measured
    fewest, so that candidates built one at a time still spread over the GPUs): with ``overlap`` (a GPU's kernels,
    which the compiles leave alone) as soon as it is built, else once every job is built (a CPU
    function runs on all cores, which the compiles would take)."""
    if builders:
        for job in jobs:
            job.module = module_path(folder, job)
    to_build, to_measure = (list(range(len(jobs))), []) if builders else ([], list(range(len(jobs))))
    busy, built, start = {}, 0, time.monotonic()  # busy: worker -> (job index, phase)
    taken = dict.fromkeys(measurers, 0)  # jobs each measuring worker took
    while to_build or to_measure or busy:
        building = to_build or any(phase == "build" for _, phase in busy.values())
        for workers, queue, phase in ((builders, to_build, "build"), (measurers, to_measure, "measure")):
            if phase == "measure" and building and not overlap:
                continue
            for worker in workers if phase == "build" else sorted(workers, key=taken.get):
                if worker not in busy and queue:
                    i = queue.pop(0)
                    worker.send(jobs[i], phase)
                    busy[worker] = i, phase
                    if phase == "measure":
                        taken[worker] += 1
        ready, _, _ = select.select([w.process.stdout for w in busy], [], [], 0.5)
        for worker in [w for w in busy if w.process.stdout in ready or time.monotonic() > w.started + timeout]:
            i, phase = busy.pop(worker)
            ms, error = worker.answer(timeout)
            if phase == "measure" or error:
                yield jobs[i], ms, error, worker.gpu if phase == "measure" else None
            if phase == "build":
                built += 1
                log(f"built [{built}/{len(jobs)}] on {len(builders)} processes, {time.monotonic() - start:.0f} s"
                    + (f" ({jobs[i].recipe.name} {jobs[i].knobs} failed: {error})" if error else ""))
                if not error:
                    to_measure.append(i)
