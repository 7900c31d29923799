"""The device code of the loop engine: one NVRTC module of kernels, and the counters they share.

``_conditional`` compiles ``SOURCE`` once per device and builds graphs of
these kernels around torch's recorded bodies. ``loop_*`` run a loop
(``loop_begin``, ``loop_count``, ``loop_check``, ``loop_tail``), keep a
shrinking loop's rows in order and choose its body (``loop_choose``), keep
it on that body while it still fits (``loop_enter``, ``loop_stay``) and
restore its history (``loop_restore``); ``choose_replay`` chooses a replay.
A conditional node's value is set with ``cudaGraphSetConditional`` by the
kernel before the node, on every launch.
"""

from __future__ import annotations

from typing import Final

# The loop's counters (``LoopCells.counters``, int64), as the kernels name them.
STEPS: Final = 0  # the steps taken by this launch (the body's step index while it runs)
LIMIT: Final = 1  # this launch's step limit
RUNNING: Final = 2  # 1 until a step sets stop
EPOCHS: Final = 3  # a shrinking loop's row orders recorded by this launch
NUM_COUNTERS: Final = 8

#: The kernels; ``{prelude}`` declares the handle type where NVRTC does not.
SOURCE: Final = r"""{prelude}
extern "C" __device__ __cudart_builtin__ void cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

#define STEPS 0
#define LIMIT 1
#define RUNNING 2
#define EPOCHS 3
#define ROWS 4    /* a shrinking loop: the rows of the body chosen last */
#define BRANCH 5  /* a shrinking loop: the body chosen last */
#define MARK 6    /* a shrinking loop: the steps when it was chosen */

__device__ bool stopped(const void *stop, int stop_bytes) {{
  return stop_bytes == 4 ? *(const int *)stop != 0 : *(const unsigned char *)stop != 0;
}}

// The step that just ran counts if no step before it set stop; the steps after stop run masked.
__device__ void count_step(long long *c, const void *stop, int stop_bytes) {{
  if (c[RUNNING]) {{
    c[STEPS] += 1;
    c[RUNNING] = !stopped(stop, stop_bytes);
  }}
}}

// Before the loop: no step ran; the first WHILE node runs while `every` steps fit under the limit.
extern "C" __global__ void loop_begin(cudaGraphConditionalHandle handle, long long *c, int every, int rows,
                                      int *order, long long *branch_steps, int branches) {{
  for (int r = threadIdx.x; r < rows; r += blockDim.x) order[r] = r;
  for (int b = threadIdx.x; b < branches; b += blockDim.x) branch_steps[b] = 0;
  if (threadIdx.x == 0) {{
    c[STEPS] = 0;
    c[RUNNING] = 1;
    c[EPOCHS] = 0;
    c[ROWS] = rows;
    c[BRANCH] = 0;
    c[MARK] = 0;
    cudaGraphSetConditional(handle, c[LIMIT] >= every ? 1u : 0u);
  }}
}}

// Between two steps of one iteration.
extern "C" __global__ void loop_count(long long *c, const void *stop, int stop_bytes) {{
  count_step(c, stop, stop_bytes);
}}

// After an iteration: count its last step (unless a body's own WHILE node did: `count` 0), add its steps
// to its body's, go on while `every` more fit and no step set stop.
extern "C" __global__ void loop_check(cudaGraphConditionalHandle handle, long long *c, const void *stop,
                                      int stop_bytes, int every, long long *branch_steps, int count) {{
  if (count) count_step(c, stop, stop_bytes);
  if (branch_steps) branch_steps[c[BRANCH]] += c[STEPS] - c[MARK];
  cudaGraphSetConditional(handle, c[RUNNING] && c[STEPS] + every <= c[LIMIT] ? 1u : 0u);
}}

// Between the two WHILE nodes: the steps left under the limit run one an iteration.
extern "C" __global__ void loop_tail(cudaGraphConditionalHandle handle, const long long *c) {{
  cudaGraphSetConditional(handle, c[RUNNING] && c[STEPS] < c[LIMIT] ? 1u : 0u);
}}

// The first of `n` ascending sizes that holds `count` (n if none does).
__device__ int first_holding(long long count, const long long *sizes, int n) {{
  int i = 0;
  while (i < n && sizes[i] < count) ++i;
  return i;
}}

// SWITCH: one handle takes the branch (a value past the last runs nothing); IF nodes: one each.
__device__ void set_branch(const unsigned long long *handles, int num_handles, int is_switch, int branch) {{
  if (is_switch) {{
    cudaGraphSetConditional(handles[0], (unsigned int)branch);
    return;
  }}
  for (int i = 0; i < num_handles; ++i) cudaGraphSetConditional(handles[i], i == branch ? 1u : 0u);
}}

// A replay chosen on the device: the smallest size that holds `live`; none above the largest.
extern "C" __global__ void choose_replay(const unsigned long long *handles, int num_handles, int is_switch,
                                         const void *live, int live_bytes, const long long *sizes, int n,
                                         long long *chosen) {{
  long long count = live_bytes == 8 ? *(const long long *)live : *(const int *)live;
  int branch = first_holding(count, sizes, n);
  chosen[0] = branch < n ? branch : -1;
  set_branch(handles, num_handles, is_switch, branch);
}}

// Before a body's own WHILE node in a shrinking loop: its first iteration runs.
extern "C" __global__ void loop_enter(cudaGraphConditionalHandle handle) {{
  cudaGraphSetConditional(handle, 1u);
}}

struct RowBuffer {{
  unsigned long long data;  // row r at data + r * stride, `bytes` long, copied `unit` bytes at a time
  long long stride;
  int bytes;
  int unit;
}};

__device__ void copy_unit(unsigned char *to, const unsigned char *from, int unit) {{
  if (unit == 8) *(unsigned long long *)to = *(const unsigned long long *)from;
  else if (unit == 4) *(unsigned int *)to = *(const unsigned int *)from;
  else if (unit == 2) *(unsigned short *)to = *(const unsigned short *)from;
  else *to = *from;
}}

// Row r of `buffer` to row dest[r], for r < rows, through `scratch`; the block is synchronized after.
__device__ void move_rows(const RowBuffer &buffer, const int *dest, int rows, unsigned char *scratch) {{
  unsigned char *data = (unsigned char *)buffer.data;
  const int units = buffer.bytes / buffer.unit;
  const long long total = (long long)rows * units;
  for (long long i = threadIdx.x; i < total; i += blockDim.x) {{
    const long long r = i / units, u = (i % units) * buffer.unit;
    copy_unit(scratch + dest[r] * (long long)buffer.bytes + u, data + r * buffer.stride + u, buffer.unit);
  }}
  __syncthreads();
  for (long long i = threadIdx.x; i < total; i += blockDim.x) {{
    const long long r = i / units, u = (i % units) * buffer.unit;
    copy_unit(data + r * buffer.stride + u, scratch + r * buffer.bytes + u, buffer.unit);
  }}
  __syncthreads();
}}

// The block's exclusive prefix sum of `value` (blockDim a multiple of 32); `total` gets the sum.
__device__ int exclusive_sum(int value, int *warp_sums, int *total) {{
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int x = value;
  for (int d = 1; d < 32; d <<= 1) {{
    int y = __shfl_up_sync(0xffffffffu, x, d);
    if (lane >= d) x += y;
  }}
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {{
    int w = lane < warps ? warp_sums[lane] : 0;
    for (int d = 1; d < 32; d <<= 1) {{
      int y = __shfl_up_sync(0xffffffffu, w, d);
      if (lane >= d) w += y;
    }}
    if (lane < warps) warp_sums[lane] = w;
    if (lane == warps - 1) *total = w;
  }}
  __syncthreads();
  return (warp ? warp_sums[warp - 1] : 0) + x - value;
}}

// A shrinking loop's iteration starts here (one block): the active rows of the `rows` in use move to
// the front in order, the inactive ones after them in order (every row buffer, `order` last: row ->
// the launch's row); the smallest body that holds the active rows is chosen; where rows moved or the
// body changed, an epoch records the steps, the rows and the order from now on.
extern "C" __global__ void loop_choose(const unsigned long long *handles, int num_handles, int is_switch,
                                       long long *c, unsigned char *active, const long long *sizes,
                                       int num_sizes, const RowBuffer *buffers, int num_buffers,
                                       unsigned char *scratch, int *order, int *orders,
                                       long long *epoch_steps, int *epoch_rows, int max_epochs,
                                       int rows_max) {{
  extern __shared__ unsigned long long dynamic_shared[];
  int *dest = (int *)dynamic_shared;  // [rows_max]
  __shared__ int warp_sums[32];
  __shared__ int live_total;
  __shared__ int moved_any;
  const int rows = (int)c[ROWS];
  const long long epoch = c[EPOCHS];
  const int t = threadIdx.x, per = (rows + (int)blockDim.x - 1) / (int)blockDim.x;
  const int lo = t * per < rows ? t * per : rows, hi = lo + per < rows ? lo + per : rows;
  int mine = 0;
  for (int r = lo; r < hi; ++r) mine += active[r] != 0;
  if (t == 0) moved_any = 0;
  int before = exclusive_sum(mine, warp_sums, &live_total);
  const int live = live_total;
  bool moved = false;
  for (int r = lo; r < hi; ++r) {{
    const bool on = active[r] != 0;
    const int d = on ? before : live + (r - before);
    before += on;
    dest[r] = d;
    moved |= d != r;
  }}
  if (moved) moved_any = 1;
  __syncthreads();
  const bool permute = moved_any != 0;
  int branch = first_holding(live, sizes, num_sizes);
  if (branch >= num_sizes) branch = num_sizes - 1;
  const int chosen_rows = (int)sizes[branch];
  if (permute) {{
    for (int b = 0; b < num_buffers; ++b) move_rows(buffers[b], dest, rows, scratch);
    for (int r = t; r < rows; r += blockDim.x) active[r] = r < live;
  }}
  const bool record = (epoch == 0 || permute || chosen_rows != rows) && epoch < max_epochs;
  if (record) {{
    for (int r = t; r < chosen_rows; r += blockDim.x) orders[epoch * rows_max + r] = order[r];
  }}
  if (t == 0) {{
    if (record) {{
      epoch_steps[epoch] = c[STEPS];
      epoch_rows[epoch] = chosen_rows;
      c[EPOCHS] = epoch + 1;
    }}
    c[ROWS] = chosen_rows;
    c[BRANCH] = branch;
    c[MARK] = c[STEPS];
    set_branch(handles, num_handles, is_switch, branch);
  }}
}}

// A body's own WHILE node in a shrinking loop, after each iteration (one block): count its last step;
// stay on this body while `every` more steps fit, no step set stop and it is still the smallest body
// that holds the active rows (counted here): the choice (and its partition) only where the body changes.
extern "C" __global__ void loop_stay(cudaGraphConditionalHandle handle, long long *c, const void *stop,
                                     int stop_bytes, int every, const unsigned char *active,
                                     const long long *sizes, int num_sizes) {{
  __shared__ int warp_sums[32];
  __shared__ int live_total;
  const int rows = (int)c[ROWS];
  int mine = 0;
  for (int r = threadIdx.x; r < rows; r += blockDim.x) mine += active[r] != 0;
  exclusive_sum(mine, warp_sums, &live_total);
  if (threadIdx.x == 0) {{
    count_step(c, stop, stop_bytes);
    const bool same = first_holding(live_total, sizes, num_sizes) == c[BRANCH];
    cudaGraphSetConditional(handle, c[RUNNING] && c[STEPS] + every <= c[LIMIT] && same ? 1u : 0u);
  }}
}}

// After a shrinking loop (a block per step): the step's history row back in the launch's row order;
// a row that step did not compute (past its epoch's rows) gets `fill`.
extern "C" __global__ void loop_restore(const long long *c, long long *history, long long stride,
                                        int rows_max, const int *orders, const long long *epoch_steps,
                                        const int *epoch_rows, int max_epochs, long long fill) {{
  const long long step = blockIdx.x;
  const long long epochs = c[EPOCHS] < max_epochs ? c[EPOCHS] : max_epochs;
  if (step >= c[STEPS] || epochs <= 1) return;
  int e = 0;
  while (e + 1 < epochs && epoch_steps[e + 1] <= step) ++e;
  extern __shared__ unsigned long long dynamic_shared[];
  long long *computed = (long long *)dynamic_shared, *restored = computed + rows_max;  // [rows_max] each
  long long *row = history + step * stride;
  for (int r = threadIdx.x; r < rows_max; r += blockDim.x) {{
    computed[r] = row[r];
    restored[r] = fill;
  }}
  __syncthreads();
  const int *order = orders + (long long)e * rows_max;
  for (int r = threadIdx.x; r < epoch_rows[e]; r += blockDim.x) restored[order[r]] = computed[r];
  __syncthreads();
  for (int r = threadIdx.x; r < rows_max; r += blockDim.x) row[r] = restored[r];
}}
"""
#: NVRTC of CUDA 12.4+ knows ``cudaGraphConditionalHandle``; older ones need the typedef.
PRELUDES: Final = ("", "typedef __device_builtin__ unsigned long long cudaGraphConditionalHandle;")
#: The kernels of ``_SOURCE``, loaded by name.
KERNELS: Final = (
    "loop_begin",
    "loop_count",
    "loop_check",
    "loop_tail",
    "loop_enter",
    "loop_stay",
    "loop_choose",
    "loop_restore",
    "choose_replay",
)
