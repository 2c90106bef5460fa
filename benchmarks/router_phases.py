"""A request's instructions by phase: client HTTP, preparation, worker calls, token work.

benchmarks/router_instructions.py counts what the router executes per request; this
splits that count among the router functions that own each phase of a request.
callgrind sees C functions only (a Python function's cost is the interpreter's), so
the router process runs with its phase-owning functions wrapped: each call (for a
coroutine or an async generator, each step it runs until it waits) goes through a C
function of a tiny extension built here, one C function per pair (phase, enclosing
phase), which calls the Python function. callgrind's inclusive cost of
`phase_<p>__in__<q>` is then what phase p ran while called from within phase q, and a
phase's own cost is the inclusive cost of its entries less that of the phases entered
within it. What no wrapped function runs (the event loop, uvloop's reads and writes
outside a phase, task steps, the wrappers' own frames) is the rest.

    python -m benchmarks.router_phases [--stream] [--chat] [--requests 100] [--warmup 20]

The wrappers add instructions of their own: a C call per wrapped function call, and
per step of a wrapped coroutine or async generator a C object that forwards the step
(plus, for a coroutine, one Python frame per call, and for an async generator a proxy
method per step). Compare the total with a plain router_instructions.py run of the same
`--requests` / `--warmup` (`--dump FILE` reads a dump again). Slow (valgrind): minutes.
Not run in CI.
"""

from __future__ import annotations

import argparse
import functools
import glob
import inspect
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

PHASES: dict[str, tuple[str, str]] = {
    # phase: (group, what it covers)
    "client_read": ("a", "client HTTP read: httptools + the protocol's callbacks, the body"),
    "client_write": ("a", "client HTTP write: status line, headers, chunks, the send"),
    "json_body": ("b", "the JSON body decoded into the request struct"),
    "prepare": ("b", "validation, SamplingParams, chat template, run and formatter set-up"),
    "tokenize": ("b", "the prompt's token ids"),
    "policy": ("b", "instance choice and decode admission"),
    "worker_http": ("c", "worker calls' HTTP: requests written, responses read and framed"),
    "relay": ("c", "the P/D relay: decode's stream opened, prefill's call, the handoff"),
    "events": ("d", "NDJSON events decoded, token batches merged"),
    "detokenize": ("d", "detokenizer, stop strings, finish, the deltas' generator"),
    "format": ("d", "OpenAI chunks / response, usage"),
    "metrics": ("e", "request record, TTFT / ITL timing, counters"),
    "serving": ("e", "serve_generation and the request task's own code"),
}
NAMES = list(PHASES)
OUTER = ["none", *NAMES]


_C_BODY = r"""
typedef PyObject *(*work_t)(void *);
typedef PyObject *(*entry_t)(work_t, void *);
static entry_t table[NUM_PHASES][NUM_PHASES];

static PyObject *in_phase(int p, work_t work, void *ctx) {
    if (current == p)  /* the same phase again: nothing to tell apart */
        return work(ctx);
    return table[p][current](work, ctx);
}

/* Phased(fn, phase): calls fn inside the phase; a method when set on a class. */
typedef struct { PyObject_HEAD PyObject *fn; int phase; vectorcallfunc vc; } Phased;
typedef struct { PyObject *fn; PyObject *const *args; size_t nargsf; PyObject *kwnames; } Call;
static PyObject *call_work(void *c) {
    Call *k = (Call *)c;
    return PyObject_Vectorcall(k->fn, k->args, k->nargsf, k->kwnames);
}
static PyObject *phased_vc(PyObject *self, PyObject *const *args, size_t nargsf,
                           PyObject *kwnames) {
    Phased *p = (Phased *)self;
    Call k = {p->fn, args, nargsf, kwnames};
    return in_phase(p->phase, call_work, &k);
}
static PyObject *phased_new(PyTypeObject *t, PyObject *args, PyObject *kw) {
    PyObject *fn; int phase;
    if (!PyArg_ParseTuple(args, "Oi", &fn, &phase)) return NULL;
    if (phase <= 0 || phase >= NUM_PHASES) { PyErr_SetString(PyExc_ValueError, "phase"); return NULL; }
    Phased *p = (Phased *)t->tp_alloc(t, 0);
    if (!p) return NULL;
    Py_INCREF(fn); p->fn = fn; p->phase = phase; p->vc = phased_vc;
    return (PyObject *)p;
}
static void phased_dealloc(PyObject *self) {
    Py_XDECREF(((Phased *)self)->fn); Py_TYPE(self)->tp_free(self);
}
static PyObject *phased_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) { Py_INCREF(self); return self; }
    return PyMethod_New(self, obj);
}
static PyTypeObject PhasedType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_router_phase.Phased", .tp_basicsize = sizeof(Phased),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Phased, vc), .tp_call = PyVectorcall_Call,
    .tp_new = phased_new, .tp_dealloc = phased_dealloc, .tp_descr_get = phased_get,
};

/* Drive(awaitable_iterator, phase): each step of it (send, throw, close) inside the
   phase; awaiting a Drive awaits the iterator. */
typedef struct { PyObject_HEAD PyObject *it; int phase; } Drive;
typedef struct { PyObject *it; PyObject *arg; } Step;
static PyObject *send_work(void *c) {
    Step *s = (Step *)c;
    PyObject *result;
    PySendResult r = PyIter_Send(s->it, s->arg, &result);
    if (r == PYGEN_NEXT) return result;
    if (r == PYGEN_ERROR) return NULL;
    /* returned: StopIteration(result) */
    PyObject *e = PyObject_CallOneArg(PyExc_StopIteration, result);
    Py_DECREF(result);
    if (e) { PyErr_SetObject(PyExc_StopIteration, e); Py_DECREF(e); }
    return NULL;
}
typedef struct { PyObject *it; const char *name; PyObject *args; } Meth;
static PyObject *meth_work(void *c) {
    Meth *m = (Meth *)c;
    PyObject *f = PyObject_GetAttrString(m->it, m->name);
    if (!f) return NULL;
    PyObject *r = PyObject_Call(f, m->args, NULL);
    Py_DECREF(f);
    return r;
}
static PyObject *drive_new(PyTypeObject *t, PyObject *args, PyObject *kw) {
    PyObject *it; int phase;
    if (!PyArg_ParseTuple(args, "Oi", &it, &phase)) return NULL;
    if (phase <= 0 || phase >= NUM_PHASES) { PyErr_SetString(PyExc_ValueError, "phase"); return NULL; }
    PyObject *awaited = it;
    if (Py_TYPE(it)->tp_as_async && Py_TYPE(it)->tp_as_async->am_await &&
        !PyCoro_CheckExact(it)) {
        awaited = Py_TYPE(it)->tp_as_async->am_await(it);  /* e.g. an asend object: itself */
        if (!awaited) return NULL;
    } else Py_INCREF(awaited);
    Drive *d = (Drive *)t->tp_alloc(t, 0);
    if (!d) { Py_DECREF(awaited); return NULL; }
    d->it = awaited; d->phase = phase;
    return (PyObject *)d;
}
static void drive_dealloc(PyObject *self) {
    Py_XDECREF(((Drive *)self)->it); Py_TYPE(self)->tp_free(self);
}
static PyObject *drive_self(PyObject *self) { Py_INCREF(self); return self; }
static PyObject *drive_send(PyObject *self, PyObject *arg) {
    Drive *d = (Drive *)self;
    Step s = {d->it, arg};
    return in_phase(d->phase, send_work, &s);
}
static PyObject *drive_next(PyObject *self) {
    PyObject *r = drive_send(self, Py_None);
    if (r == NULL && PyErr_ExceptionMatches(PyExc_StopIteration)) {
        /* tp_iternext: a StopIteration with a value must stay set for the awaiter */
    }
    return r;
}
static PyObject *drive_throw(PyObject *self, PyObject *args) {
    Drive *d = (Drive *)self;
    Meth m = {d->it, "throw", args};
    return in_phase(d->phase, meth_work, &m);
}
static PyObject *drive_close(PyObject *self, PyObject *unused) {
    Drive *d = (Drive *)self;
    PyObject *none = PyTuple_New(0);
    Meth m = {d->it, "close", none};
    PyObject *r = in_phase(d->phase, meth_work, &m);
    Py_DECREF(none);
    return r;
}
static PyMethodDef drive_methods[] = {
    {"send", drive_send, METH_O, NULL},
    {"throw", drive_throw, METH_VARARGS, NULL},
    {"close", drive_close, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL}};
static PyAsyncMethods drive_async = {.am_await = drive_self};
static PyTypeObject DriveType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_router_phase.Drive", .tp_basicsize = sizeof(Drive),
    .tp_flags = Py_TPFLAGS_DEFAULT, .tp_new = drive_new, .tp_dealloc = drive_dealloc,
    .tp_iter = drive_self, .tp_iternext = drive_next, .tp_methods = drive_methods,
    .tp_as_async = &drive_async,
};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "_router_phase", NULL, -1, NULL};
PyMODINIT_FUNC PyInit__router_phase(void) {
    fill();
    if (PyType_Ready(&PhasedType) < 0 || PyType_Ready(&DriveType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (!m) return NULL;
    Py_INCREF(&PhasedType); PyModule_AddObject(m, "Phased", (PyObject *)&PhasedType);
    Py_INCREF(&DriveType); PyModule_AddObject(m, "Drive", (PyObject *)&DriveType);
    return m;
}
"""


def c_source() -> str:
    """One entry function per (phase, enclosing phase), `phase_<p>__in__<q>`: it sets
    the current phase, runs the work given, restores the phase. `Phased` calls a
    function inside a phase, `Drive` steps an awaitable inside one."""
    n = len(NAMES) + 1
    lines = ["#define PY_SSIZE_T_CLEAN", "#include <Python.h>", "#include <stddef.h>"]
    lines.append("static int current = 0;")
    lines.append("typedef PyObject *(*work_t)(void *);")
    entries = []
    for i, name in enumerate(NAMES, 1):
        for j, outer in enumerate(OUTER):
            fn = f"phase_{name}__in__{outer}"
            entries.append((i, j, fn))
            lines.append(
                f"__attribute__((noinline)) PyObject *{fn}(work_t work, void *ctx) {{"
                f" int saved = current; current = {i}; PyObject *r = work(ctx);"
                " current = saved; return r; }"
            )
    body = _C_BODY.replace("NUM_PHASES", str(n)).replace(
        "typedef PyObject *(*work_t)(void *);\n", "", 1
    )
    lines.append(body.split("static PyObject *in_phase", 1)[0])
    lines.append("static void fill(void) {")
    lines += [f"  table[{i}][{j}] = {fn};" for i, j, fn in entries]
    lines.append("}")
    lines.append("static PyObject *in_phase" + body.split("static PyObject *in_phase", 1)[1])
    return "\n".join(lines)


def build(out_dir: str) -> None:
    src = Path(out_dir) / "_router_phase.c"
    src.write_text(c_source())
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [
            *("gcc", "-O1", "-g", "-shared", "-fPIC", f"-I{include}", str(src)),
            *("-o", str(Path(out_dir) / f"_router_phase{suffix}")),
        ],
        check=True,
        timeout=300,
    )


# -- the router process's side: wrap the phase-owning functions ----------------------------


class _AgenProxy:
    """An async generator whose every step runs inside a phase."""

    __slots__ = ("_agen", "_drive", "_phase")

    def __init__(self, agen: Any, drive: Any, phase: int) -> None:
        self._agen, self._drive, self._phase = agen, drive, phase

    def __aiter__(self) -> _AgenProxy:
        return self

    def __anext__(self) -> Any:
        return self._drive(self._agen.__anext__(), self._phase)

    def asend(self, value: Any) -> Any:
        return self._drive(self._agen.asend(value), self._phase)

    def athrow(self, *args: Any) -> Any:
        return self._drive(self._agen.athrow(*args), self._phase)

    def aclose(self) -> Any:
        return self._drive(self._agen.aclose(), self._phase)


def _wrapped(f: Any, phase: str, ext: Any) -> Any:
    """`f` with each call (a coroutine's or async generator's each step) in `phase`."""
    i = NAMES.index(phase) + 1
    drive = ext.Drive
    if inspect.isasyncgenfunction(f):

        def agen(*a: Any, **k: Any) -> Any:
            return _AgenProxy(f(*a, **k), drive, i)

        return functools.wraps(f)(agen)
    if inspect.iscoroutinefunction(f):  # a coroutine still (tasks are made of them)

        async def coro(*a: Any, **k: Any) -> Any:
            return await drive(f(*a, **k), i)

        return functools.wraps(f)(coro)
    return ext.Phased(f, i)


class _Decoder:
    """A msgspec decoder whose `decode` runs inside a phase."""

    def __init__(self, real: Any, ext: Any, phase: str) -> None:
        self.decode = ext.Phased(real.decode, NAMES.index(phase) + 1)


def install() -> None:
    """Wrap the router's phase-owning functions (in the module that calls each)."""
    import _router_phase as ext  # type: ignore[import-not-found]

    from router import (
        client_conn,
        generation_cycle,
        http1,
        http_limits,
        metrics,
        output,
        preprocess,
        prompt_tokens,
        relay,
        server,
        serving,
        worker_client,
        write_coalescing,
    )

    def patch(owner: Any, phase: str, *names: str) -> None:
        for name in names:
            f = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
            setattr(owner, name, _wrapped(f, phase, ext))

    patch(http_limits.GuardedHttpToolsProtocol, "client_read", "data_received")
    patch(generation_cycle.GenerationCycle, "client_read", "read_body")
    patch(server.NoDelayHttpToolsProtocol, "client_write", "on_response_complete")
    patch(write_coalescing.CoalescingTransport, "client_write", "flush")
    patch(client_conn.JSONReply, "client_write", "__call__")
    patch(client_conn.SSEResponse, "client_write", "__call__")
    patch(generation_cycle.GenerationCycle, "serving", "run_asgi")
    patch(serving, "serving", "serve_generation")
    patch(serving, "json_body", "decode_json", "read_json_body")
    patch(preprocess.Preprocessor, "prepare", "completion", "chat")
    patch(serving.ServingContext, "prepare", "check_auth", "session_of")
    patch(serving, "prepare", "choice_request", "_open_stream", "formatter_for")
    patch(prompt_tokens.PromptEncoder, "tokenize", "encode")
    patch(relay.RequestRun, "policy", "_pick", "_admit_decode")
    patch(relay.RequestRun, "relay", "_run")
    patch(worker_client.WorkerClient, "worker_http", "_events")
    patch(http1._Connection, "worker_http", "data_received")
    patch(worker_client, "events", "merge_batches", "_decode_event")
    init = worker_client.WorkerClient.__init__

    def client_init(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        for attr in ("_prefill_decoder", "_decode_decoder", "_generate_decoder"):
            setattr(self, attr, _Decoder(getattr(self, attr), ext, "events"))

    worker_client.WorkerClient.__init__ = client_init  # type: ignore[method-assign]
    patch(output.OutputStream, "detokenize", "deltas", "_build_text")
    patch(serving, "format", "first_delta", "full_body", "stream_body", "usage_of")
    patch(serving, "format", "num_output_tokens")
    patch(metrics.RequestRecord, "metrics", "__init__", "finish")
    patch(metrics.RouterMetrics, "metrics", "on_route")
    patch(output.RequestTiming, "metrics", "on_tokens")


# -- reading the dump ----------------------------------------------------------------------


def phase_costs(dump: str) -> dict[str, Any]:
    """Inclusive cost of every phase entry in `dump`, and each phase's own cost."""
    text = subprocess.run(
        ["callgrind_annotate", "--inclusive=yes", "--threshold=100", dump],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    total_match = re.search(r"^([\d,]+)(?: \([^)]*\))?\s+PROGRAM TOTALS", text, re.M)
    assert total_match is not None, "no totals in callgrind_annotate's output"
    total = int(total_match.group(1).replace(",", ""))
    inclusive: dict[tuple[str, str], int] = {}
    for m in re.finditer(
        r"^\s*([\d,]+)(?: \([^)]*\))?\s+\S*:phase_(\w+?)__in__(\w+)\b", text, re.M
    ):
        inclusive[(m.group(2), m.group(3))] = int(m.group(1).replace(",", ""))
    own = {p: 0 for p in NAMES}
    for (inner, outer), cost in inclusive.items():
        own[inner] += cost
        if outer != "none":
            own[outer] -= cost
    return {
        "total": total,
        "own": own,
        "inclusive": {f"{i}/{o}": c for (i, o), c in inclusive.items()},
    }


def phase_calls(dump: str) -> dict[str, int]:
    """How many times each phase entry was called (the dump's `calls=` lines)."""
    names: dict[str, str] = {}
    calls: dict[str, int] = {}
    callee = ""
    with open(dump, errors="replace") as f:
        for line in f:
            if line.startswith(("fn=", "cfn=")):
                ref = line.split("=", 1)[1].strip()
                key, _, name = ref.partition(" ")
                if name:
                    names[key] = name
                if line.startswith("cfn="):
                    callee = names.get(key, key)
            elif line.startswith("calls=") and callee.startswith("phase_"):
                calls[callee] = calls.get(callee, 0) + int(line[6:].split()[0])
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--chat", action="store_true")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--dump", default=None, help="only read this callgrind dump")
    args = parser.parse_args()
    if args.dump:
        costs = phase_costs(args.dump)
        costs["calls"] = phase_calls(args.dump)
        print(json.dumps(costs, indent=2))
        report(costs, args.requests)
        return
    import uvloop

    from benchmarks import router_instructions

    ext_dir = tempfile.mkdtemp(prefix="router-phases-")
    build(ext_dir)
    ns = argparse.Namespace(
        stream=args.stream,
        chat=args.chat,
        distinct=False,
        requests=args.requests,
        warmup=args.warmup,
        concurrency=1,
        ttft_ms=20.0,
        idle_s=10.0,
        router_path=ext_dir,  # put first on the processes' PYTHONPATH: the extension
    )
    result = uvloop.run(router_instructions.run(ns, router_module="benchmarks.router_phases"))
    dumps = sorted(glob.glob(f"{result['dump_dir']}/callgrind.out.*.1"))
    assert dumps, "no dump of the counted requests"
    result["phases"] = phase_costs(dumps[0])
    result["phases"]["calls"] = phase_calls(dumps[0])
    print(json.dumps(result, indent=2))
    report(result["phases"], args.requests)


def report(costs: dict[str, Any], requests: int) -> None:
    total = costs["total"]
    own = costs["own"]
    print(f"total {total / requests / 1e6:.3f} M instructions per request")
    groups: dict[str, int] = {}
    for name, (group, what) in PHASES.items():
        groups[group] = groups.get(group, 0) + own[name]
        print(
            f"  {group} {name:13s} {own[name] / requests / 1e3:8.1f} k  {own[name] / total:6.1%}  {what}"
        )
    rest = total - sum(own.values())
    for group, cost in sorted(groups.items()):
        print(f"group {group}: {cost / requests / 1e3:8.1f} k  {cost / total:6.1%}")
    print(f"rest (no phase): {rest / requests / 1e3:8.1f} k  {rest / total:6.1%}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-router":
        install()
        from benchmarks.router_overhead import main as overhead_main

        overhead_main()
    else:
        main()
