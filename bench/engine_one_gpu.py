"""Study: the NVLink engine on one GPU, a world of one rank, where no second GPU is lent.

    python3 bench/engine_one_gpu.py TREE [--check] [--against BASE] [--gpu-time] [--profile] [--pieces]

The engine is built directly (the registry refuses a group of one rank: a
sub-group's rendezvous its peers would not make), so its kernels and their
launches run on one device. ``--check`` holds it bitwise against the NCCL
transport (dispatch, combine, backward; plain, ``max_rows`` and by 2 groups, and
forward and backward with ``max_rows`` captured in a CUDA graph and replayed;
native and fp8 wires; T = 0 to 2048; the most experts it takes; on every SM and at ``sm_budget=24``), its
host work issued by the compiled path (``dispatch.host``), then on every SM from
Python.
``--gpu-time``: the captured forward round trip's GPU time at every SM and at 24
blocks (:func:`gpu_time`), and beside the experts' forward
(:func:`beside_experts`). Then the eager round trip's host time
at the decode and DeepSeek-V3 shapes, on the engine and on the NCCL transport
(wall time from dispatch to combine's return, the GPU idle at the start; median
of 800): of TREE alone, or with ``--against BASE`` of both source trees in one
process (BASE's package imported first and its modules moved aside, then
TREE's), in alternating blocks of 40 round trips, with their ratio: between
processes the same tree's host time varied 1.5x on one machine, within one
process it holds to a few percent; and TREE's on the engine less the wait at
its host read (the compiled counts exchange's ``last_wait_ns``: host time as the
target states it). ``--profile``: a cProfile of 50 decode round
trips of TREE first; ``--pieces``: the host cost of the round trip's pieces one
by one (a launch, an allocation, a host read, the free-memory budget, an
autograd node, an agreement), and the NCCL transport's plan graphs (their
kernels, GPU time and host replay time) first. TREE and BASE are source trees
(this one, or an older one, e.g. ``git archive BASE | tar -x -C .wt/base``).
"""
import importlib
import os
import statistics
import sys
import time

import torch

if len(sys.argv) < 2 or sys.argv[1].startswith("-"):
    sys.exit(__doc__)
if not torch.cuda.is_available():
    print("bench/engine_one_gpu.py needs a CUDA device (and CuPy)", file=sys.stderr)
    sys.exit(2)
import torch.distributed as dist  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("PORT", "29561"))
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))


def _ours() -> dict:
    """The ``dispatch`` modules imported now, by name."""
    return {name: module for name, module in sys.modules.items() if name == "dispatch" or name.startswith("dispatch.")}


def load(tree: str):
    """The ``dispatch`` package of source tree ``tree``, imported afresh (the
    modules of one imported before are moved aside, and keep working)."""
    for name in _ours():
        del sys.modules[name]
    sys.path.insert(0, os.path.abspath(tree))
    try:
        import dispatch
        import dispatch.dispatcher
        import dispatch.transports
    finally:
        sys.path.pop(0)
    MODULES[dispatch] = _ours()
    return dispatch


def use(package) -> None:
    """Make ``package``'s modules the imported ``dispatch`` ones, so that an
    import inside one of its functions finds its own tree's module."""
    for name in _ours():
        del sys.modules[name]
    sys.modules.update(MODULES[package])


MODULES: dict = {}  # each loaded package's modules
BASE = sys.argv[sys.argv.index("--against") + 1] if "--against" in sys.argv else None
packages = {"base": load(BASE)} if BASE else {}
packages["tree"] = load(sys.argv[1])
dispatch = packages["tree"]
same_bits = importlib.import_module("dispatch.bench.common").same_bits  # the tree's: dtype, shape and bits
print(f"machine: {torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores; torch {torch.__version__}; tree "
      f"{os.environ.get('DISPATCH_COMMIT', '?')}" + (f" against {BASE}" if BASE else ""), flush=True)


def make(E, transport, wire="native", package=dispatch, sm_budget=None):
    cfg = package.DispatchConfig(num_experts=E, transport=transport, dispatch_wire=wire,
                                 tuning=package.Tuning(sm_budget=sm_budget))
    transports = package.transports
    cls = transports.NVLinkTransport if transport == "nvlink" else transports.AllToAllTransport
    return package.dispatcher.TokenDispatcher(cfg, None, cls(cfg, None))


def inputs(T, H, E, K, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
    scores = torch.rand(T, E, generator=gen, device="cuda")
    w, idx = scores.topk(K, dim=1)
    return x, idx, (w / w.sum(1, keepdim=True)).float()


def trip(d, x, idx, w, whole=False, **kw):
    """A round trip's results (rows, weights, sources, counts, output, gradients, values
    brought home to their slots, signed zeros among them); the rows as many as received
    (``whole``: every row of a max_rows output, no host read)."""
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    out = d.dispatch(x, idx, w, **kw)
    y = out.tokens.float().pow(2).to(out.tokens.dtype)
    h = d.combine(y, out.handle, weights=out.weights)
    h.float().sum().backward()
    values = out.weights.detach() * 5
    values[::3] = -0.0
    slots = d.combine_slots(values, out.handle)
    n = None if whole else out.handle.num_rows if "max_rows" not in kw else int(out.tokens_per_expert.sum())
    return [out.tokens[:n], out.weights[:n], out.src_rank[:n], out.src_token[:n], out.tokens_per_expert, h, x.grad,
            w.grad, slots]


bad = 0  # cases of --check that differ: the script exits 1 at its end if any did


def check(budgets, path: str) -> None:
    """The engine bitwise against NCCL, at each SM budget; ``path``: how its host work is issued."""
    global bad
    for budget in budgets:
        for wire in ("native", "fp8"):
            E = 16
            eng, ref = make(E, "nvlink", wire, sm_budget=budget), make(E, "nccl", wire)
            for T, H, K in ((0, 256, 4), (5, 256, 4), (300, 512, 4), (2048, 1024, 8)):
                x, idx, w = inputs(T, H, E, K, T)
                want = trip(ref, x, idx, w)
                # ({} twice: the second dispatch of a signature is the usual one compiled, dispatch.usual)
                for i, kw in enumerate(({}, {}, {"max_rows": T * K + 8}, {"groups": 2})):
                    got = trip(eng, x, idx, w, **kw)
                    same = all(same_bits(a, b) for a, b in zip(got, want))
                    bad += not same
                    print(f"{path}sm_budget={budget} wire={wire} T={T} H={H} K={K} {kw}{' again' * (i == 1)}: "
                          f"{'bitwise equal' if same else 'DIFFERENT'}", flush=True)
        # the most experts the engine takes (its layout kernels' shared memory at the bound)
        E = importlib.import_module("dispatch.nvlink_layout").most_experts(1)
        eng, ref = make(E, "nvlink", sm_budget=budget), make(E, "nccl")
        x, idx, w = inputs(300, 256, E, 8, 3)
        want = trip(ref, x, idx, w)
        for kw in ({}, {}, {"max_rows": 300 * 8}, {"groups": 2}):
            same = all(same_bits(a, b) for a, b in zip(trip(eng, x, idx, w, **kw), want))
            bad += not same
            print(f"{path}sm_budget={budget} E={E} (the most) {kw}: {'bitwise equal' if same else 'DIFFERENT'}",
                  flush=True)
        # forward and backward with max_rows captured in one CUDA graph, replayed on new inputs
        for wire in ("native", "fp8"):
            E, T, H, K = 16, 300, 512, 4
            eng, ref = make(E, "nvlink", wire, sm_budget=budget), make(E, "nccl", wire)
            static = [t.clone() for t in inputs(T, H, E, K, 7)]
            for _ in range(2):
                trip(eng, *static, max_rows=T * K + 8)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                got = trip(eng, *static, whole=True, max_rows=T * K + 8)
            for seed in range(3):
                for s, t in zip(static, inputs(T, H, E, K, 100 + seed)):
                    s.copy_(t)
                graph.replay()
                want = trip(ref, *static)
                n = want[0].shape[0]
                same = all(same_bits(a[:n] if i < 4 else a, b) for i, (a, b) in enumerate(zip(got, want)))
                bad += not same
                print(f"{path}sm_budget={budget} wire={wire} T={T} captured, replay {seed}: "
                      f"{'bitwise equal' if same else 'DIFFERENT'}", flush=True)


def layer_check(path: str) -> None:
    """MoEExchange with one group over the engine bitwise against it over NCCL, forward and backward, three steps
    in a row (its backward's exchanges run on the communication stream; the next forward's dispatch and combine
    still take the compiled calls), plain and with max_rows (each dispatch polls the engine's status); and how many
    of the engine's dispatches the compiled call made."""
    global bad
    E, T, H, F, K = 16, 300, 512, 256, 4
    for kw in ({}, {"max_rows": T * K + 8}):
        eng, ref = make(E, "nvlink"), make(E, "nccl")
        taken, result = [], eng._usual._result if eng._usual is not None else None
        if result is not None:
            eng._usual._result = lambda *args: taken.append(1) or result(*args)
        torch.manual_seed(5)
        experts = dispatch.experts.GroupedExperts(E, H, F, dtype=torch.bfloat16, device="cuda")
        layers = [dispatch.MoEExchange(d, experts, **kw) for d in (eng, ref)]
        for step in range(3):
            x, idx, w = inputs(T, H, E, K, 40 + step)
            runs = []
            for layer in layers:
                xs, ws = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                h = layer(xs, idx, ws)
                h.float().pow(2).sum().backward()
                runs.append([h, xs.grad, ws.grad, *[p.grad for p in experts.parameters()]])
                experts.zero_grad(set_to_none=True)
            same = all(same_bits(a, b) for a, b in zip(*runs))
            bad += not same
            print(f"{path}MoEExchange(groups=1) {kw} step {step}: {'bitwise equal' if same else 'DIFFERENT'}",
                  flush=True)
        print(f"{path}MoEExchange(groups=1) {kw}: {len(taken)} of 3 dispatches by the compiled call", flush=True)


if "--check" in sys.argv:
    layer_check("")
    check((None, 24), "")
    # the same with the engine's host work issued from Python (new engines, made without the compiled path)
    dispatch.host.enabled = False
    dispatch.nvlink._ENGINES.clear()
    check((None,), "host in Python: ")
    layer_check("host in Python: ")
    dispatch.host.enabled = True
    dispatch.nvlink._ENGINES.clear()
    print("check:", "all equal" if bad == 0 else f"{bad} different", flush=True)


def host_pieces() -> None:
    """The host cost of the pieces of an eager round trip (us a call, median of 2000)."""
    checks, free_memory, plan = dispatch.checks, dispatch.free_memory, dispatch.plan
    d = make(256, "nvlink")
    T, H, E, K = 128, 7168, 256, 8
    x, idx, w = inputs(T, H, E, K, 0)
    dev = torch.device("cuda", 0)
    small = torch.zeros(64, dtype=torch.int32, device=dev)
    eng = d.transport.engine
    k = eng._kernel("intranode_combine.cu", "store_pair")
    table = torch.zeros(8, dtype=torch.int64, device=dev)

    class F(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            return a.new_empty(0)

        @staticmethod
        def backward(ctx, g):
            return None, None

    anchor = torch.empty(0, device=dev, requires_grad=True)

    def rt():
        out = d.dispatch(x, idx, w)
        return d.combine(out.tokens, out.handle, weights=out.weights)

    pieces = {
        "free_bytes (mem_get_info + allocator stats)": lambda: free_memory.free_bytes(dev),
        "torch.cuda.mem_get_info": lambda: torch.cuda.mem_get_info(0),
        "memory_stats_as_nested_dict": lambda: torch.cuda.memory_stats_as_nested_dict(0),
        "torch.empty [64] int32 cuda": lambda: torch.empty(64, dtype=torch.int32, device=dev),
        "small device tensor .tolist() (a host read)": lambda: small.tolist(),
        "kernel launch, 5 named args (store_pair)": lambda: k(1, table=table, at=0, stride=4, a=1, b=2),
        "autograd Function.apply, 2 inputs": lambda: F.apply(x, anchor),
        "board agree (W=1)": lambda: d._calls.agree(d._calls.ticket("combine")),
        "checks.check_dispatch_inputs": lambda: checks.check_dispatch_inputs(x, idx, w, d.devices),
        "plan.header": lambda: plan.header(x, w, K),
        "eager round trip (decode)": rt,
    }
    for name, fn in pieces.items():
        for _ in range(50):
            fn()
        torch.cuda.synchronize()
        ts = []
        n = 300 if "round trip" in name else 2000
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
        print(f"{name:48s} {statistics.median(ts):8.1f} us", flush=True)


def nccl_plan_graphs() -> None:
    """The NCCL transport's plan before its host read at the decode shape: its two
    CUDA graphs (the kernels each replays, their GPU time, a replay's host time)."""
    from torch.profiler import ProfilerActivity, profile

    d = make(256, "nccl")
    x, idx, w = inputs(128, 7168, 256, 8, 0)
    for _ in range(5):  # the second dispatch of a shape captures its plan, the later ones replay it
        out = d.dispatch(x, idx, w)
        d.combine(out.tokens, out.handle, weights=out.weights)
    torch.cuda.synchronize()
    captured = next(c for c in d.transport._graphs._plans.values() if c is not None)
    for name, graph in (("graph 1 (route)", captured.graph1), ("graph 2 (send plan)", captured.graph2)):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        replays = []
        for _ in range(300):
            torch.cuda.synchronize()
            t = time.perf_counter()
            graph.replay()
            replays.append((time.perf_counter() - t) * 1e6)
        print(f"nccl plan {name}: {len(kernels)} kernels and copies, {sum(e.device_time for e in kernels):.1f} us "
              f"of GPU, replay {statistics.median(replays):.1f} us on the host", flush=True)


_FLOOR_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#include <cuda.h>
#include <dlfcn.h>
#include <chrono>
static double now_us() {
  return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
// each: the mean cost of one of n calls made back to back in C++, in us
double alloc_loop(int64_t n, torch::Tensor like) {
  double t = now_us();
  for (int64_t i = 0; i < n; ++i) { auto a = torch::empty({64}, like.options()); }
  return (now_us() - t) / n;
}
double op_loop(int64_t n, torch::Tensor like) {
  double t = now_us();
  for (int64_t i = 0; i < n; ++i) like.zero_();
  return (now_us() - t) / n;
}
double slice_loop(int64_t n, torch::Tensor like) {
  double t = now_us();
  for (int64_t i = 0; i < n; ++i) { auto a = like.slice(0, 4, 32); }
  return (now_us() - t) / n;
}
typedef CUresult (*Launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                           CUstream, void**, void**);
double launch_loop(int64_t n, int64_t function, int64_t table, int64_t threads) {  // store_pair(table, 0, 4, 1, 2)
  auto launch = (Launch)dlsym(dlopen("libcuda.so.1", RTLD_NOW), "cuLaunchKernel");
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  long long where = table, a = 1, b = 2;
  int at = 0, stride = 4;
  void* params[] = {&where, &at, &stride, &a, &b};
  double t = now_us();
  for (int64_t i = 0; i < n; ++i) launch((CUfunction)function, 1, 1, 1, threads, 1, 1, 0, stream, params, nullptr);
  return (now_us() - t) / n;
}
double record_loop(int64_t n) {
  cudaEvent_t event;
  cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  auto stream = at::cuda::getCurrentCUDAStream().stream();
  double t = now_us();
  for (int64_t i = 0; i < n; ++i) cudaEventRecord(event, stream);
  return (now_us() - t) / n;
}
"""


def compiled_floor() -> None:
    """What the pieces cost issued from C++ (a small extension built here, the calls
    made back to back): the floor of a compiled per-call path on this host, beside
    the same piece from Python (us a call, median of 100 runs of 200)."""
    from torch.utils import cpp_extension
    try:
        ext = cpp_extension.load_inline("floor_probe", cpp_sources=_FLOOR_SOURCE, with_cuda=True,
                                        functions=["alloc_loop", "op_loop", "slice_loop", "launch_loop", "record_loop"])
    except Exception as error:  # no compiler or ninja here: say so, measure the rest
        print(f"compiled floor: the extension did not build ({type(error).__name__})", flush=True)
        return
    dev = torch.device("cuda", 0)
    like = torch.zeros(64, dtype=torch.int32, device=dev)
    table = torch.zeros(8, dtype=torch.int64, device=dev)
    kernel = dispatch.cuda.kernel("intranode_combine.cu", "store_pair")
    event, stream = torch.cuda.Event(), torch.cuda.current_stream()

    def in_python(fn):
        for _ in range(200):
            fn()
        runs = []
        for _ in range(100):
            t = time.perf_counter()
            for _ in range(200):
                fn()
            runs.append((time.perf_counter() - t) / 200 * 1e6)
        torch.cuda.synchronize()
        return statistics.median(runs)

    def in_cxx(loop):
        loop(200)
        runs = [loop(200) for _ in range(100)]
        torch.cuda.synchronize()
        return statistics.median(runs)

    for name, cxx, py in (
        ("an allocation (torch.empty [64] int32)", lambda n: ext.alloc_loop(n, like),
         lambda: torch.empty(64, dtype=torch.int32, device=dev)),
        ("a torch op with one kernel (zero_)", lambda n: ext.op_loop(n, like), like.zero_),
        ("a view (slice)", lambda n: ext.slice_loop(n, like), lambda: like[4:32]),
        ("a launch (store_pair; ours: named args)",
         lambda n: ext.launch_loop(n, kernel.handle(0), table.data_ptr(), kernel.threads),
         lambda: kernel(1, table=table, at=0, stride=4, a=1, b=2)),
        ("an event record", lambda n: ext.record_loop(n), lambda: event.record(stream)),
    ):
        print(f"compiled floor, {name:40s} C++ {in_cxx(cxx):6.2f} us, Python {in_python(py):6.2f} us", flush=True)




def quantile(values, q):
    return sorted(values)[int(q * (len(values) - 1))]


def gpu_time() -> None:
    """The engine's captured forward round trip (dispatch with max_rows, combine) on
    the GPU, of each tree, at every SM and at 24 blocks: replays timed by events in
    alternating blocks (median of 60, us), and the tree's kernels at 24 blocks
    (torch.profiler, DeepSeek-V3)."""
    # the largest first: an engine's bounded dispatches are sized by its first
    for name, (T, H, E, K) in (("deepseek-v3", (4096, 7168, 256, 8)), ("decode", (128, 7168, 256, 8))):
        x, idx, w = inputs(T, H, E, K, 0)
        graphs = {}
        for budget in (None, 24):
            for label, package in packages.items():
                use(package)
                d = make(E, "nvlink", package=package, sm_budget=budget)
                for _ in range(3):
                    out = d.dispatch(x, idx, w, max_rows=T * K)
                    d.combine(out.tokens, out.handle, weights=out.weights)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = d.dispatch(x, idx, w, max_rows=T * K)
                    d.combine(out.tokens, out.handle, weights=out.weights)
                graphs[label, budget] = graph
                rows, counts = out.tokens, out.tokens_per_expert  # the rows one dispatch delivers (the same in every)
        times = {key: [] for key in graphs}
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for block in range(6):
            for key in (graphs if block % 2 else reversed(list(graphs))):
                graphs[key].replay()
                for _ in range(10):
                    start.record()
                    graphs[key].replay()
                    end.record()
                    end.synchronize()
                    times[key].append(start.elapsed_time(end) * 1e3)
        for budget in (None, 24):
            told = "; ".join(f"{label} {statistics.median(times[label, budget]):.0f} us" for label in packages)
            ratio = ""
            if BASE:
                ratio = (f"; tree/base "
                         f"{statistics.median(times['tree', budget]) / statistics.median(times['base', budget]):.3f}")
            print(f"nvlink {name}: captured forward round trip on the GPU, sm_budget {budget}, median of "
                  f"{len(times['tree', budget])}: {told}{ratio}", flush=True)
        if name == "deepseek-v3":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    graphs["tree", 24].replay()
                torch.cuda.synchronize()
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
            beside_experts(graphs, rows, counts, E, H, ffn=2048)
    use(packages["tree"])


def beside_experts(graphs, rows, counts, E, H, ffn) -> None:
    """The experts' forward (GroupedExperts on the rows one dispatch delivers, a CUDA
    graph; its GEMMs on every SM, or leaving 24 to the exchange) and each captured
    round trip queued at once on two streams (the round trip on a high-priority
    one), against each alone: the share of the shorter one that running them side
    by side saved, (T_A + T_B - T_A+B) / min(T_A, T_B), the three taken together
    (median of 16 rounds, us); then the kernels' timeline of one such pair. At
    W = 1 the exchange's link is this GPU's memory."""
    from dispatch.experts import GroupedExperts
    experts = GroupedExperts(E, H, ffn, dtype=torch.bfloat16, device=rows.device)

    def captured(carveout: int):
        """The experts' forward in a CUDA graph, its GEMMs leaving ``carveout`` SMs."""
        before = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(carveout)
        try:
            with torch.no_grad():
                for _ in range(2):
                    experts(rows, counts)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    experts(rows, counts)
        finally:
            torch._C._set_sm_carveout_experimental(before)
        return graph

    computes = {0: captured(0), 24: captured(24)}
    side, high = torch.cuda.Stream(), torch.cuda.Stream(priority=-1)

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(step) -> float:
        """One run of ``step`` on an idle GPU, us."""
        torch.cuda.synchronize()
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3

    def together(exchange, compute):
        def run():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            high.wait_stream(main)
            with torch.cuda.stream(side):
                compute.replay()
            with torch.cuda.stream(high):
                exchange.replay()
            main.wait_stream(side)
            main.wait_stream(high)
        return run

    # in rounds, the pairs in turn (every other round reversed), each pair's three times taken
    # together: the GPU's clock drifts over the seconds of 10 ms GEMMs, so that times taken apart
    # (or one pair after the other) compare runs of different speeds
    for carveout, compute in computes.items():
        pairs = [key for key in graphs if not (carveout and key[1] is None)]
        runs: dict = {key: [] for key in pairs}
        for _ in range(3):  # warm
            timed(compute.replay)
        for r in range(16):
            for key in pairs if r % 2 else reversed(pairs):
                t_a, t_b = timed(compute.replay), timed(graphs[key].replay)
                runs[key].append((t_a, t_b, timed(together(graphs[key], compute))))
        for (label, budget), values in runs.items():
            t_a, t_b, t_ab = (statistics.median(v[i] for v in values) for i in range(3))
            saved = statistics.median((a + b - ab) / min(a, b) for a, b, ab in values)
            print(f"beside the experts' forward (GEMMs leaving {carveout} SMs: {t_a:.0f} us): {label} round trip, "
                  f"sm_budget {budget}: {t_b:.0f} us alone, {t_ab:.0f} us together ({t_a + t_b:.0f} one after the "
                  f"other): saved {saved:.2f} of the shorter (median of 16 rounds)", flush=True)
    for key in [(label, 24) for label in ("tree", "base") if (label, 24) in graphs]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            together(graphs[key], computes[24])()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        if kernels:
            t0 = kernels[0].time_range.start
            print(f"{key[0]} at sm_budget {key[1]} beside the experts leaving 24 SMs, the kernels (start, duration, "
                  f"us):", flush=True)
            for e in kernels:
                print(f"  {e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f}  {e.name[:60]}", flush=True)


if "--gpu-time" in sys.argv:  # first: an engine's bounded dispatches are sized by its first (the largest here)
    gpu_time()
if "--pieces" in sys.argv:
    host_pieces()
    compiled_floor()
    nccl_plan_graphs()


for (name, (T, H, E, K)), transport in ((shape, transport) for transport in ("nvlink", "nccl") for shape in (
        ("decode", (128, 7168, 256, 8)), ("deepseek-v3", (4096, 7168, 256, 8)))):
    x, idx, w = inputs(T, H, E, K, 0)
    trips = {}
    for label, package in packages.items():
        use(package)
        d = make(E, transport, package=package)

        def rt(d=d):
            out = d.dispatch(x, idx, w)
            return d.combine(out.tokens, out.handle, weights=out.weights)

        for _ in range(20):
            rt()
        trips[label] = rt
    torch.cuda.synchronize()
    walls = {label: [] for label in trips}
    tree_host = MODULES[packages["tree"]].get("dispatch.host")
    compiled = tree_host.built() if transport == "nvlink" and tree_host is not None else None
    waited = getattr(compiled, "last_wait_ns", None)  # the host read's wait, where the tree's host path has it
    less_wait = []
    for block in range(20):
        for label in (trips if block % 2 else reversed(list(trips))):
            use(packages[label])
            rt = trips[label]
            for _ in range(3):
                rt()
            torch.cuda.synchronize()
            for _ in range(40):
                t0 = time.perf_counter()
                rt()
                t1 = time.perf_counter()
                torch.cuda.synchronize()
                walls[label].append((t1 - t0) * 1e6)
                if label == "tree" and waited is not None:
                    less_wait.append((t1 - t0) * 1e6 - waited() / 1e3)
    use(packages["tree"])
    if "--profile" in sys.argv and name == "decode" and transport == "nvlink":
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(50):
            trips["tree"]()
        prof.disable()
        torch.cuda.synchronize()
        st = pstats.Stats(prof)
        print(f"calls per round trip: {st.total_calls / 50:.0f}")
        st.sort_stats("tottime").print_stats(35)
    told = "; ".join(f"{label} {statistics.median(v):.0f} us (p10 {quantile(v, 0.1):.0f}, p90 {quantile(v, 0.9):.0f})"
                     for label, v in walls.items())
    ratio = ""
    if BASE:
        ratio = f"; tree/base {statistics.median(walls['tree']) / statistics.median(walls['base']):.3f}"
    print(f"{transport} {name}: eager round trip, host wall from dispatch to combine's return, median of "
          f"{len(walls['tree'])}: "
          f"{told}{ratio}", flush=True)
    if less_wait:
        print(f"{transport} {name}: eager round trip, tree, host wall less the wait at the host read: median "
              f"{statistics.median(less_wait):.0f} us (p10 {quantile(less_wait, 0.1):.0f}, p90 "
              f"{quantile(less_wait, 0.9):.0f})", flush=True)
dist.destroy_process_group()
sys.exit(1 if bad else 0)
