"""CUPTI's module callbacks in C, so that they never wait for Python's GIL (issue 31).

CUPTI calls its subscriber while the driver loads a module, with the driver's (or CUPTI's) lock held. A callback
written in Python (``ctypes``) must take the GIL first. A thread that holds the GIL and loads a module itself
(torch's static Triton launcher calls ``cuModuleLoadData`` without releasing it) then waits for that lock while
the callback waits for the GIL: both threads stop for good. vLLM 0.26 loads its compiled artifacts on a thread
pool, each thread loading Triton modules; on an H100 (2026-12-05) an engine with the graph kind on hung there for
more than 7 minutes, every thread asleep (docs/bench/gpu-vllm-graphs-deadlock-h100-2026-12-05.txt: one thread in
the Python callback waiting for the GIL, another in ``load_kernel``).

The callback here takes no GIL: it copies each reported image and notes each module load's handle into a queue
behind a mutex of its own, and :class:`~weightcache.graphs.cubins.CubinRecorder` drains the queue when it is
asked something (hashing and parsing the images there, outside every driver lock). The C source below is built
once per machine with the system's C compiler (``$CC`` or ``cc``; Triton, which vLLM and torch.compile use,
needs one too) into ``$XDG_CACHE_HOME/weightcache/native`` (default ``~/.cache``), by the SHA-256 of the source,
and loaded with ``ctypes``. Where no compiler works, :func:`load_shim` raises
:class:`~weightcache.errors.GraphRestoreError`: the recorder is not made, and graphs are captured as usual.

The library holds one more loop that must not wait for the GIL, ``wc_add_nodes``: a run of a graph's kernel nodes,
their launch attributes and its memset nodes added in one call (:class:`~weightcache.graphs.driver.CudaGraphDriver`
uses it where the library loads). Made one ``ctypes`` call a node or attribute, a graph built on a worker thread
takes the GIL back after each, and waits for it as long as the interpreter's switch interval (5 ms) whenever the
caller's thread runs Python meanwhile: the graphs an engine has built ahead while it prepares its inputs would be
built a node every 5 ms. (Every kernel node described on the H200 and the H100 had a launch attribute, its cluster
scheduling policy, so the first loop, over attribute-free kernel nodes alone, never ran there; and vLLM's graphs
held 832 memset nodes in the H100's probe of 2026-12-05, each of which ended the second loop's runs.)

Layer L3; imports no torch.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from ..errors import GraphRestoreError

#: Event kinds of the queue (``wc_take``): an image (its sequence number, its bytes, and in ``module`` 1 where it
#: was reported during a driver module load, whose end will name it), a module load's end (its handle, and the
#: sequence numbers of the images reported during it), a module unloaded (its handle), a context torn down.
EVENT_IMAGE, EVENT_MODULE, EVENT_UNLOAD, EVENT_CONTEXT = 1, 2, 3, 4

#: The C type of a CUPTI callback (``CUpti_CallbackFunc``): user data, domain, callback id, callback data.
CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p)

SOURCE = r"""
/* weightcache: CUPTI module callbacks that take no GIL (weightcache/graphs/cupti_shim.py). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct { uint32_t site; const char *name; const void *params; const void *result; } wc_call;
typedef struct { void *context; void *stream; const void *descriptor; } wc_resource;
typedef struct { uint32_t module_id; size_t cubin_size; const char *cubin; } wc_module;

typedef struct wc_event {
    struct wc_event *next;
    int kind;
    uint64_t seq, module;
    char *data;
    size_t size;
} wc_event;

/* event kinds: EVENT_IMAGE, EVENT_MODULE, EVENT_UNLOAD, EVENT_CONTEXT of the Python module */
enum { WC_IMAGE = 1, WC_MODULE = 2, WC_UNLOAD = 3, WC_CONTEXT = 4 };

#define WC_LOADS 8
#define WC_DEPTH 16
#define WC_REPORTED 32

typedef struct {
    pthread_mutex_t lock;
    wc_event *head, *tail;
    uint64_t seq;
    uint64_t dropped;
    uint64_t queued;  /* bytes the queued events hold (images, mostly) */
    int stopped;      /* wc_stop was called: nothing is queued from then on */
    uint32_t driver, resource, module_loaded, context_destroy, unload;
    uint32_t loads[WC_LOADS], from_memory[WC_LOADS];
    int nloads, nfrom_memory, follows;
    uint64_t max_elf;
} wc_state;

typedef struct { uint64_t seqs[WC_REPORTED]; int n, over; } wc_pending;

static __thread int wc_own;  /* loading_kept_images() depth on this thread */
static __thread int wc_depth;
static __thread wc_pending wc_stack[WC_DEPTH];

wc_state *wc_new(uint32_t driver, uint32_t resource, uint32_t module_loaded, uint32_t context_destroy,
                 uint32_t unload, const uint32_t *loads, int nloads, const uint32_t *from_memory, int nfrom_memory,
                 uint64_t max_elf) {
    if (nloads < 0 || nfrom_memory < 0 || nloads > WC_LOADS || nfrom_memory > WC_LOADS) return NULL;
    if (max_elf > ((uint64_t)1 << 40)) max_elf = (uint64_t)1 << 40;  /* no sum below can wrap */
    wc_state *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    pthread_mutex_init(&st->lock, NULL);
    st->driver = driver; st->resource = resource; st->module_loaded = module_loaded;
    st->context_destroy = context_destroy; st->unload = unload; st->max_elf = max_elf;
    for (int i = 0; i < nloads; i++) st->loads[i] = loads[i];
    st->nloads = nloads;
    for (int i = 0; i < nfrom_memory; i++) st->from_memory[i] = from_memory[i];
    st->nfrom_memory = nfrom_memory;
    return st;
}

void wc_follow(wc_state *st, int on) { __atomic_store_n(&st->follows, on, __ATOMIC_RELEASE); }
/* Enter (+1) or leave (-1) a stretch of loads this thread makes itself; 0 reads this thread's depth (and makes
   its thread-local storage: load_shim calls it once right after loading, outside any driver lock). */
int wc_own_add(int delta) { wc_own += delta; if (wc_own < 0) wc_own = 0; return wc_own; }
void wc_release(char *data) { free(data); }
uint64_t wc_dropped(wc_state *st) {
    pthread_mutex_lock(&st->lock);
    uint64_t n = st->dropped;
    pthread_mutex_unlock(&st->lock);
    return n;
}

static int wc_in(const uint32_t *set, int n, uint32_t x) {
    for (int i = 0; i < n; i++) if (set[i] == x) return 1;
    return 0;
}

/* An event lost for want of memory. */
static void wc_drop(wc_state *st) {
    pthread_mutex_lock(&st->lock);
    st->dropped++;
    pthread_mutex_unlock(&st->lock);
}

/* Queue an event; data (malloc'ed, or NULL) becomes the queue's. Its sequence number, 0 where it was dropped. */
static uint64_t wc_push(wc_state *st, int kind, uint64_t module, char *data, size_t size) {
    wc_event *e = malloc(sizeof *e);
    if (!e) { wc_drop(st); free(data); return 0; }
    pthread_mutex_lock(&st->lock);
    if (st->stopped) {  /* (read under the lock: a callback that began before wc_stop queues nothing after it) */
        pthread_mutex_unlock(&st->lock);
        free(e); free(data);
        return 0;
    }
    e->next = NULL; e->kind = kind; e->seq = ++st->seq; e->module = module; e->data = data; e->size = size;
    if (st->tail) st->tail->next = e; else st->head = e;
    st->tail = e;
    st->queued += size;
    uint64_t seq = e->seq;
    pthread_mutex_unlock(&st->lock);
    return seq;
}

/* An image (copied); in_load: reported during a driver module load this thread makes (its end names it). */
static uint64_t wc_image(wc_state *st, const void *image, size_t size, int in_load) {
    char *copy = malloc(size);
    if (!copy) { wc_drop(st); return 0; }
    memcpy(copy, image, size);
    return wc_push(st, WC_IMAGE, (uint64_t)in_load, copy, size);
}

static uint64_t wc_u64(const unsigned char *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static uint32_t wc_u32(const unsigned char *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint16_t wc_u16(const unsigned char *p) { uint16_t v; memcpy(&v, p, 2); return v; }

/* The length of the 64-bit little-endian ELF file at p: the end of its farthest table, section or segment; 0 for
   anything else or anything longer than max. */
static uint64_t wc_elf_size(const unsigned char *p, uint64_t max) {
    if (memcmp(p, "\x7f" "ELF", 4) != 0) return 0;  /* (a PTX text may be shorter than an ELF header) */
    if (p[4] != 2 || p[5] != 1) return 0;
    uint64_t phoff = wc_u64(p + 0x20), shoff = wc_u64(p + 0x28);
    uint64_t phentsize = wc_u16(p + 0x36), phnum = wc_u16(p + 0x38);
    uint64_t shentsize = wc_u16(p + 0x3A), shnum = wc_u16(p + 0x3C);
    if (phoff > max || shoff > max) return 0;
    uint64_t end = 64;
    if (phoff + phnum * phentsize > end) end = phoff + phnum * phentsize;
    if (shoff + shnum * shentsize > end) end = shoff + shnum * shentsize;
    if (end > max || (shnum && shentsize < 64) || (phnum && phentsize < 56)) return 0;
    for (uint64_t i = 0; i < shnum; i++) {
        const unsigned char *s = p + shoff + i * shentsize;
        uint64_t offset = wc_u64(s + 24), size = wc_u64(s + 32);
        if (wc_u32(s + 4) == 8) continue;  /* SHT_NOBITS takes no room in the file */
        if (offset > max || size > max) return 0;
        if (offset + size > end) end = offset + size;
    }
    for (uint64_t i = 0; i < phnum; i++) {
        const unsigned char *s = p + phoff + i * phentsize;
        uint64_t offset = wc_u64(s + 8), filesz = wc_u64(s + 32);
        if (offset > max || filesz > max) return 0;
        if (offset + filesz > end) end = offset + filesz;
    }
    return end <= max ? end : 0;
}

static void wc_driver_call(wc_state *st, uint32_t cbid, const wc_call *call) {
    void *const *params = call->params;
    if (cbid == st->unload) {
        if (call->site == 0 && params && params[0]) wc_push(st, WC_UNLOAD, (uint64_t)(uintptr_t)params[0], NULL, 0);
        return;
    }
    if (call->site == 0) {
        if (wc_depth < WC_DEPTH) { wc_stack[wc_depth].n = 0; wc_stack[wc_depth].over = 0; }
        wc_depth++;
        return;
    }
    if (call->site != 1 || wc_depth <= 0) return;
    wc_depth--;
    if (wc_depth >= WC_DEPTH) return;
    wc_pending *p = &wc_stack[wc_depth];
    int failed = !params || !params[0] || !call->result || *(const int *)call->result != 0;
    uint64_t module = failed ? 0 : (uint64_t)(uintptr_t)*(void *const *)params[0];  /* 0: no module */
    if (module && p->n == 0 && !p->over && wc_in(st->from_memory, st->nfrom_memory, cbid) && params[1]) {
        uint64_t size = wc_elf_size(params[1], st->max_elf);  /* a cubin the module callback did not report */
        if (size) {
            uint64_t seq = wc_image(st, params[1], size, 1);
            if (seq) p->seqs[p->n++] = seq;
        }
    }
    if (p->n == 0) return;
    /* the load's end, also where it failed or reported too many images (module 0: they name no module) */
    char *seqs = malloc(sizeof(uint64_t) * p->n);
    if (!seqs) { wc_drop(st); return; }
    memcpy(seqs, p->seqs, sizeof(uint64_t) * p->n);
    wc_push(st, WC_MODULE, p->over ? 0 : module, seqs, sizeof(uint64_t) * p->n);
}

void wc_callback(void *userdata, uint32_t domain, uint32_t cbid, const void *data) {
    wc_state *st = userdata;
    if (!st || !data || wc_own) return;
    if (domain == st->driver) {
        int follows = __atomic_load_n(&st->follows, __ATOMIC_ACQUIRE);
        if (follows && (wc_in(st->loads, st->nloads, cbid) || cbid == st->unload)) wc_driver_call(st, cbid, data);
        return;
    }
    if (domain != st->resource) return;
    if (cbid == st->context_destroy) { wc_push(st, WC_CONTEXT, 0, NULL, 0); return; }
    if (cbid != st->module_loaded) return;
    const wc_resource *resource = data;
    if (!resource->descriptor) return;
    const wc_module *module = resource->descriptor;
    if (!module->cubin || !module->cubin_size) return;
    if (__atomic_load_n(&st->stopped, __ATOMIC_ACQUIRE)) return;  /* no copy (wc_push would free it) */
    /* reported during a followed load of this thread: that load's end names it (where it has room to) */
    wc_pending *p = wc_depth > 0 && wc_depth <= WC_DEPTH ? &wc_stack[wc_depth - 1] : NULL;
    int noted = p && p->n < WC_REPORTED;
    if (p && !noted) p->over = 1;
    uint64_t seq = wc_image(st, module->cubin, module->cubin_size, noted);
    if (seq && noted) p->seqs[p->n++] = seq;
    else if (noted) p->over = 1;  /* dropped (no memory): the load can no longer tell its image */
}

/* Bytes the queued events hold. */
uint64_t wc_queued(wc_state *st) {
    pthread_mutex_lock(&st->lock);
    uint64_t n = st->queued;
    pthread_mutex_unlock(&st->lock);
    return n;
}

/* Queue nothing more (a callback CUPTI still delivers, or one running now, queues nothing: wc_push reads the flag
   under the lock; a driver call's entry and exit are still counted, so that a thread's nesting stays right) and
   free what is queued; the bytes freed. The state itself stays: a callback may be running on another thread. */
uint64_t wc_stop(wc_state *st) {
    pthread_mutex_lock(&st->lock);
    __atomic_store_n(&st->stopped, 1, __ATOMIC_RELEASE);
    wc_event *e = st->head;
    uint64_t freed = st->queued;
    st->head = st->tail = NULL;
    st->queued = 0;
    pthread_mutex_unlock(&st->lock);
    while (e) { wc_event *next = e->next; free(e->data); free(e); e = next; }
    return freed;
}

/* Pop the oldest event: 1 and its fields (data is the caller's to wc_release), or 0 where the queue is empty. */
int wc_take(wc_state *st, int *kind, uint64_t *seq, uint64_t *module, char **data, uint64_t *size) {
    pthread_mutex_lock(&st->lock);
    wc_event *e = st->head;
    if (e) { st->head = e->next; if (!st->head) st->tail = NULL; st->queued -= e->size; }
    pthread_mutex_unlock(&st->lock);
    if (!e) return 0;
    *kind = e->kind; *seq = e->seq; *module = e->module; *data = e->data; *size = e->size;
    free(e);
    return 1;
}

/* Not CUPTI's: a run of a graph's nodes added in one call from Python, which lets go of the GIL once for all of
   them (graphs/driver.py, CudaGraphDriver.add_description). Node i is a kernel node where kinds[i] is 0 (the next
   of `kernels`, `kernel_stride` bytes apart, added with `add_kernel`, cuGraphAddKernelNode_v2; then its counts[i]
   launch attributes set with `set`, cuGraphKernelNodeSetAttribute: they follow each other from `attributes` on,
   `attribute_stride` bytes apart, each a 32-bit id and at `value_offset` its 64-byte value, copied to aligned
   memory first since the rows are packed), and a memset node where kinds[i] is 1 (the next of `memsets`,
   `memset_stride` bytes apart, added with `add_memset`, cuGraphAddMemsetNode, in `context`). Each is added
   without dependencies, its handle into nodes[i]. 0, or the first failing CUresult, with the index of its node in
   *failed and in *failed_call 0 (a kernel node's add), 1 (an attribute's) or 2 (a memset node's add). */
typedef int (*wc_add_kernel)(void **node, void *graph, void *const *deps, size_t count, const void *params);
typedef int (*wc_set_attribute)(void *node, int id, const void *value);
typedef int (*wc_add_memset)(void **node, void *graph, void *const *deps, size_t count, const void *params,
                             void *context);
int wc_add_nodes(void *add_kernel, void *set, void *add_memset, void *graph, void *context, const uint8_t *kinds,
                 size_t count, const char *kernels, size_t kernel_stride, const uint32_t *counts,
                 const char *attributes, size_t attribute_stride, size_t value_offset, const char *memsets,
                 size_t memset_stride, void **nodes, size_t *failed, int *failed_call) {
    wc_add_kernel add_kernel_node = (wc_add_kernel)add_kernel;
    wc_set_attribute set_attribute = (wc_set_attribute)set;
    wc_add_memset add_memset_node = (wc_add_memset)add_memset;
    for (size_t i = 0; i < count; i++) {
        int code;
        if (kinds[i] == 1) {
            code = add_memset_node(&nodes[i], graph, NULL, 0, memsets, context);
            memsets += memset_stride;
            if (code != 0) { *failed = i; *failed_call = 2; return code; }
            continue;
        }
        code = add_kernel_node(&nodes[i], graph, NULL, 0, kernels);
        kernels += kernel_stride;
        if (code != 0) { *failed = i; *failed_call = 0; return code; }
        for (uint32_t k = 0; k < counts[i]; k++, attributes += attribute_stride) {
            uint32_t id;
            uint64_t value[8];
            memcpy(&id, attributes, sizeof id);
            memcpy(value, attributes + value_offset, sizeof value);
            code = set_attribute(nodes[i], (int)id, value);
            if (code != 0) { *failed = i; *failed_call = 1; return code; }
        }
    }
    return 0;
}
"""

#: How the shim is compiled (with the compiler's own words on failure).
FLAGS = ("-O2", "-shared", "-fPIC", "-pthread")


def _native_dir() -> Path:
    """Where built shims are kept: ``$XDG_CACHE_HOME/weightcache/native`` (default ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "weightcache" / "native"


def _compiler() -> list[str]:
    """The compiler's command (``$CC`` may hold arguments: ``ccache gcc``)."""
    chosen = shlex.split(os.environ.get("CC", "")) or [shutil.which("cc") or shutil.which("gcc") or ""]
    if not chosen[0]:
        raise GraphRestoreError(
            "no C compiler was found (neither $CC nor cc nor gcc) to build weightcache's CUPTI callback, so the "
            "machine code of a graph's kernels is not kept and its graphs are captured as usual; install one "
            "(e.g. apt install gcc), or set CC"
        )
    return chosen


def _name() -> str:
    """The library's file name: by the source, the flags, ``$CC`` where set, the C library and the machine (a
    cache directory shared by machines or containers never hands one a library built for another); found there,
    it loads without a compiler."""
    libc = "-".join(platform.libc_ver())
    made = "\0".join([SOURCE, *FLAGS, os.environ.get("CC", ""), libc, platform.machine()])
    return f"wc_cupti_{hashlib.sha256(made.encode()).hexdigest()[:16]}_{platform.machine()}.so"


def _trusted(path: Path) -> bool:
    """Whether ``path`` is a file this user owns that no one else may write (a library found in a shared cache
    directory is loaded into the process: never one someone else could have put there)."""
    try:
        st = path.stat()
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def build_shim(directory: Path | None = None) -> Path:
    """The shared library built from :data:`SOURCE` (built on the first call on a machine; later calls find it).
    Raises :class:`~weightcache.errors.GraphRestoreError` where it cannot be built, with the compiler's words."""
    target_dir = directory if directory is not None else _native_dir()
    target = target_dir / _name()
    if _trusted(target):
        return target
    compiler = _compiler()
    try:
        target_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        work = tempfile.mkdtemp(dir=target_dir, prefix=".build-")
    except OSError as exc:
        raise GraphRestoreError(
            f"the directory for weightcache's CUPTI callback, {target_dir}, cannot be made or written ({exc}): "
            "graphs are captured as usual; set XDG_CACHE_HOME to a writable directory"
        ) from exc
    try:
        source = Path(work) / "wc_cupti.c"
        source.write_text(SOURCE)
        built = Path(work) / target.name
        command = [*compiler, *FLAGS, "-o", str(built), str(source)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise GraphRestoreError(
                f"building weightcache's CUPTI callback with {shlex.join(compiler)} failed ({exc}): graphs are "
                "captured as usual; install a working C compiler or set CC"
            ) from exc
        if done.returncode != 0:
            raise GraphRestoreError(
                f"building weightcache's CUPTI callback with {shlex.join(compiler)} failed (exit "
                f"{done.returncode}): {done.stderr.strip()[-600:]}; graphs are captured as usual; install a working "
                "C compiler or set CC"
            )
        try:
            built.chmod(0o755)
            os.replace(built, target)  # atomic: a process building beside this one finds one whole file either way
        except OSError as exc:  # (another user's file there, in a directory we may not replace it in)
            raise GraphRestoreError(
                f"weightcache's CUPTI callback could not be put at {target} ({exc}): graphs are captured as usual; "
                "set XDG_CACHE_HOME to a directory of your own"
            ) from exc
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    u32, u64, ptr = ctypes.c_uint32, ctypes.c_uint64, ctypes.c_void_p
    lib.wc_new.argtypes = [u32, u32, u32, u32, u32, ctypes.POINTER(u32), ctypes.c_int, ctypes.POINTER(u32)]
    lib.wc_new.argtypes += [ctypes.c_int, u64]
    lib.wc_new.restype = ptr
    lib.wc_follow.argtypes = [ptr, ctypes.c_int]
    lib.wc_follow.restype = None
    lib.wc_own_add.argtypes = [ctypes.c_int]
    lib.wc_own_add.restype = ctypes.c_int
    lib.wc_release.argtypes = [ptr]
    lib.wc_release.restype = None
    lib.wc_dropped.argtypes = [ptr]
    lib.wc_dropped.restype = u64
    lib.wc_queued.argtypes = [ptr]
    lib.wc_queued.restype = u64
    lib.wc_stop.argtypes = [ptr]
    lib.wc_stop.restype = u64
    lib.wc_callback.argtypes = [ptr, u32, u32, ptr]
    lib.wc_callback.restype = None
    out = ctypes.POINTER
    lib.wc_take.argtypes = [ptr, out(ctypes.c_int), out(u64), out(u64), out(ptr), out(u64)]
    lib.wc_take.restype = ctypes.c_int
    size = ctypes.c_size_t
    lib.wc_add_nodes.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, size, ptr, size, ptr, ptr, size, size, ptr, size]
    lib.wc_add_nodes.argtypes += [ptr, ctypes.POINTER(size), ctypes.POINTER(ctypes.c_int)]
    lib.wc_add_nodes.restype = ctypes.c_int
    # This thread's first use of the library's thread-local storage, here and not first inside a CUPTI callback:
    # before glibc 2.35 a dlopen'ed library's first thread-local access may take the loader's lock, which a thread
    # in dlopen holds while its constructors call the driver (the deadlock this module exists to avoid).
    lib.wc_own_add(0)
    return lib


@functools.cache
def load_shim() -> ctypes.CDLL:
    """The built shim, loaded, its functions' types declared (once a process). A library the cache directory
    holds that does not load (a directory mounted noexec) is built again in a private temporary directory."""
    path = build_shim()
    try:
        return _declare(ctypes.CDLL(str(path)))
    except OSError as first:
        private = ""
        try:
            private = tempfile.mkdtemp(prefix="weightcache-native-")
            return _declare(ctypes.CDLL(str(build_shim(Path(private)))))  # (mapped: the file may go)
        except (OSError, GraphRestoreError) as exc:
            raise GraphRestoreError(
                f"weightcache's CUPTI callback {path} does not load ({first}), nor one built in a private "
                f"directory ({exc}): graphs are captured as usual"
            ) from exc
        finally:
            if private:
                shutil.rmtree(private, ignore_errors=True)


def loaded_shim() -> ctypes.CDLL | None:
    """The shim if this process has loaded it already (a recorder exists or existed), else None."""
    return load_shim() if load_shim.cache_info().currsize else None


__all__ = [
    "CALLBACK",
    "FLAGS",
    "EVENT_CONTEXT",
    "EVENT_IMAGE",
    "EVENT_MODULE",
    "EVENT_UNLOAD",
    "SOURCE",
    "build_shim",
    "load_shim",
    "loaded_shim",
]
