//! What the crate's CubeCL kernels share: launch shapes, output allocation and the in-cube sum
//! of per-unit partial results.

use burn::tensor::Shape;
use burn_cubecl::CubeBackend;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};

/// Bytes of shared memory a cube may use for its partial sums (half of the 32 kB that every
/// backend offers, Metal included).
const SHARED_BYTES: usize = 16 * 1024;

/// Units per cube for reductions of `slots` values per unit: a power of two up to `most` whose
/// partial sums fit [`SHARED_BYTES`] and the device's cube size.
pub(crate) fn threads_for(tensor: &CubeTensor, slots: usize, most: usize) -> usize {
    let element = tensor.dtype.size().max(4);
    let limit = (SHARED_BYTES / (slots.max(1) * element))
        .min(most)
        .min(tensor.client.properties().hardware.max_units_per_cube as usize)
        .max(1);
    1 << limit.ilog2()
}

/// A launch of one cube of `threads` units per item, for `items` items.
pub(crate) fn per_item(tensor: &CubeTensor, items: usize, threads: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new_1d(threads as u32);
    let count = calculate_cube_count_elemwise(&tensor.client, items * threads, dim);
    (count, dim)
}

/// An uninitialised contiguous tensor of `shape` on `like`'s device, of its float type.
pub(crate) fn empty(like: &CubeTensor, shape: Shape) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype)
}

/// The CubeCL backend every runtime shares.
pub(crate) type Cube = CubeBackend;

pub(crate) mod kernels {
    use cubecl::prelude::*;

    /// Sums `slots` values per unit over the cube, in `shared` (`slots` per unit, unit-major);
    /// the totals end in the first `slots` entries. The cube's size is a power of two.
    #[cube]
    pub(crate) fn sum_over_cube<E: Float>(shared: &mut Shared<[E]>, #[comptime] slots: usize) {
        let unit = UNIT_POS as usize;
        let mut stride = CUBE_DIM as usize / 2;
        while stride > 0 {
            if unit < stride {
                for k in 0..slots {
                    let value = shared[(unit + stride) * slots + k];
                    shared[unit * slots + k] += value;
                }
            }
            sync_cube();
            stride /= 2;
        }
    }
}
