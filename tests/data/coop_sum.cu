// A cooperative kernel for weightcache's GPU test of cooperative graph nodes (tests/test_graphs.py): every block
// sums its share of `x` into `partial`, the whole grid synchronizes (cooperative_groups' grid.sync(), which needs a
// cooperative launch), then block 0 adds the partial sums into `out` and writes `scale` times the total.
// coop_sum.ptx beside it is this file compiled by CUDA 13.0: nvcc -arch=compute_90 -ptx coop_sum.cu -o coop_sum.ptx
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

extern "C" __global__ void coop_sum(const float* x, float* partial, float* out, int n, float scale) {
    cg::grid_group grid = cg::this_grid();
    __shared__ float shared[256];
    float acc = 0.0f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) acc += x[i];
    shared[threadIdx.x] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) shared[threadIdx.x] += shared[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) partial[blockIdx.x] = shared[0];
    grid.sync();
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        float total = 0.0f;
        for (int b = 0; b < gridDim.x; ++b) total += partial[b];
        out[0] = scale * total;
    }
}
