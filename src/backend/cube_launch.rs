//! What the crate's CubeCL kernels share: launch shapes, output allocation and the in-cube sum
//! of per-unit partial results.

use burn::backend::cubecl::dtype_to_storage_type;
use burn::backend::ops::FloatTensorOps;
use burn::tensor::{DType, Shape};
use burn_cubecl::CubeBackend;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::ir::{ElemType, HardwareProperties};
use cubecl::{CubeCount, CubeDim, calculate_cube_count_elemwise};

/// Bytes of shared memory a cube may use for its partial sums (half of the 32 kB that every
/// backend offers, Metal included).
const SHARED_BYTES: usize = 16 * 1024;

/// Units per cube for reductions of `slots` values per unit: a power of two up to `most` whose
/// partial sums fit [`SHARED_BYTES`] and the device's cube size.
pub(crate) fn threads_for(tensor: &CubeTensor, slots: usize, most: usize) -> usize {
    let hardware = &tensor.client.properties().hardware;
    threads_on(hardware, tensor.dtype.size(), slots, most)
}

/// [`threads_for`] on a device's `hardware`, for tensors of `element_bytes` a value.
pub(crate) fn threads_on(
    hardware: &HardwareProperties,
    element_bytes: usize,
    slots: usize,
    most: usize,
) -> usize {
    let element = element_bytes.max(4);
    let limit = (SHARED_BYTES / (slots.max(1) * element))
        .min(most)
        .min(hardware.max_units_per_cube as usize)
        .max(1);
    1 << limit.ilog2()
}

/// A launch of one cube of `threads` units per item, for `items` items.
pub(crate) fn per_item(tensor: &CubeTensor, items: usize, threads: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new_1d(threads as u32);
    let count = calculate_cube_count_elemwise(&tensor.client, items * threads, dim);
    (count, dim)
}

/// The float type of a kernel's tensors and the type it sums in: `f32` for `f16` and `bf16`,
/// whose 11- and 8-bit significands lose long sums (a row's norm over thousands of entries, a
/// weight's gradient over thousands of tokens), else the tensors' own type. Each sum then
/// rounds once, where it is stored, as Burn's matmul and reductions do.
pub(crate) fn float_types(dtype: DType) -> [ElemType; 2] {
    [
        dtype_to_storage_type(dtype),
        dtype_to_storage_type(summing_dtype(dtype)),
    ]
}

/// The type [`float_types`] sums `dtype`'s tensors in, as a tensor type: partial sums that one
/// kernel leaves for another (per-cube sums of a gradient, reduced by [`column_sums`]) are
/// stored in it, so that a half-precision gradient rounds once, not once per cube (where the
/// cubes' parts cancel, each part's rounding is a large share of the total).
pub(crate) fn summing_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 if knobs().half_sums_in_f32 => DType::F32,
        other => other,
    }
}

/// An uninitialised tensor of `shape` in the type `like`'s float type sums in
/// ([`summing_dtype`]), on its device: a kernel's partial sums.
pub(crate) fn empty_partials(like: &CubeTensor, shape: Shape) -> CubeTensor {
    let dtype = summing_dtype(like.dtype);
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// A launch of one unit per element, for `len` elements on `like`'s device.
pub(crate) fn per_element(like: &CubeTensor, len: usize) -> (CubeCount, CubeDim) {
    let dim = CubeDim::new(&like.client, len);
    (calculate_cube_count_elemwise(&like.client, len, dim), dim)
}

/// Shared memory a cube of the tiled row kernels may use (below the 32 kB every backend offers):
/// at 256 units a cube, mHC's forward keeps 25 sums a unit (25.6 kB in f32) beside its rows'
/// `H_pre`.
const TILE_SHARED_BYTES: usize = 28 * 1024;

/// Units that stride one row in the tiled row kernels.
const ROW_GROUP: usize = 8;

/// How [`weights_product`] runs: Burn's matmul, or its own two kernels taking `rows_per_step`
/// rows of `x` per step of a unit's loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ProductPath {
    Matmul,
    Kernel { rows_per_step: usize },
}

/// Entries of a unit's row whose loads the row gradient's pass over a weight tile issues
/// together (`tiled_row_gradient`), rather than one entry at a time, each entry's loads of the
/// row, the earlier gradient and the block input's gradient waited for in turn (not yet
/// measured on a GPU).
const ROW_GRADIENT_BATCH: usize = 4;

/// Rows per step of [`weights_product`]'s loop: their loads of `x` issued together, so a unit
/// has a step's rows in flight rather than one row's (not yet measured on a GPU).
const PRODUCT_ROWS_PER_STEP: usize = 8;

/// How the normalised table's kernels multiply by `Φ`: through their own tiles of `Φ` in shared
/// memory (forward `xΦ`, backward `(s δ) Φᵀ` inside the kernels), or with Burn's matmul (tensor
/// cores where the runtime uses them), after which the forward passes over the rows only for
/// their sums of squares and the backward adds the other terms of `∂x` in a pass of its own.
/// On CUDA the matmul rounds f32 inputs to TF32, as every Burn f32 matmul there; the tiles do
/// not.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ProjectionPath {
    Tiles,
    Matmul,
}

/// How the gated table's kernels (HC's, frac-connections') read `W [w, C]`: each unit its
/// entries `W[j, ·]` straight from global memory, consecutive units `C` words apart (a warp's
/// load spans `C` cache lines), or staged: each step of the row's loop, the cube first copies
/// the step's `threads × C` block of `W` into shared memory, the units reading consecutive
/// words, then each unit reads its entries there (`C | 1` apart, so in distinct banks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum GatedWeights {
    Direct,
    Staged,
}

/// The forms of the tiled kernels that a GPU measurement compares, each with an environment
/// variable, read once per process (a value out of range leaves the default):
/// - `row_group`, `BURN_CONNECTIVITY_ROW_GROUP`: units per row of the tiled row kernels, a power
///   of two from 2 to 32 (default [`ROW_GROUP`]; on an H200, 16 and 32 were slower than 8,
///   BENCHMARKS.md, fifth lease);
/// - `row_gradient_batch`, `BURN_CONNECTIVITY_ROW_GRADIENT_BATCH`: entries of a unit's row
///   whose loads the row gradient's pass over a tile issues together, a power of two from 1
///   (the pass before, one entry at a time) to 16 (default [`ROW_GRADIENT_BATCH`]; capped at
///   the unit's entries a tile);
/// - `tile_units`, `BURN_CONNECTIVITY_TILE_UNITS`: units per cube of the tiled row kernels, at
///   most, a power of two from 32 to 1024 (default [`MOST_TILE_THREADS`]; 128 is the form
///   before); a tile holds at most [`MOST_TILE_ENTRIES`] entries of `w` whatever the cube's
///   size, so more units a cube are more rows sharing each tile (fewer cubes reading all of
///   `W`) at the same work a unit; fewer where the cube's sums would pass its shared memory;
/// - `tile_padding`, `BURN_CONNECTIVITY_TILE_PADDING`: `odd` (the tiles before) or `vector`
///   (default), the distance between a weight tile's entries in the tiled row kernels
///   ([`TilePadding`]);
/// - `weights_product`, `BURN_CONNECTIVITY_WEIGHTS_PRODUCT`: `matmul` (Burn's matmul; faster
///   than the crate's kernel for mHC's shape and ten times slower for HC's, measured on
///   different GPUs) or the kernel's rows per step, a power of two from 1 (the kernel before the
///   steps) to 16 (default [`PRODUCT_ROWS_PER_STEP`]);
/// - `table_projection`, `BURN_CONNECTIVITY_TABLE_PROJECTION`: `matmul` or `tiles` (default),
///   for the normalised table's products with `Φ` (mHC's, V4's, mHC-lite's);
/// - `gated_weights`, `BURN_CONNECTIVITY_GATED_WEIGHTS`: `staged` or `direct` (default), for
///   the gated table's reads of `W`;
/// - `gated_rows`, `BURN_CONNECTIVITY_GATED_ROWS`: rows per cube of the gated table's backward
///   kernel, each entry's weights read once for all of them, a power of two from 1 (default) to
///   8. Its forward kernel takes whole tokens (the block input it makes needs all of a token's
///   `U` rows): `max(1, R / U)` tokens a cube, so one token's rows by default.
///
///   The backward's defaults are the kernels the fifth lease measured; the forward's one token
///   a cube (since the block input moved into it) and the other forms were not yet measured on
///   a GPU.
///
/// Two more have no variable: `half_sums_in_f32` (see [`float_types`]), which only the tests
/// turn off, the mutation that their half-precision checks must tell apart; and
/// `most_summing_units`, the most units per cube of the weights' product and of the gated
/// finishing kernel's sums over `W`'s rows (default [`MOST_SUMMING_UNITS`]), which only the
/// tests lower, so that these launches spread past one grid axis at widths lavapipe can run
/// (at the default, past 65535 cubes only at rows of millions of entries). The tests run the
/// kernels with other knobs too (`with_each_knobs`, in test builds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Knobs {
    pub row_group: usize,
    pub row_gradient_batch: usize,
    pub tile_units: usize,
    pub tile_padding: TilePadding,
    pub weights_product: ProductPath,
    pub table_projection: ProjectionPath,
    pub gated_weights: GatedWeights,
    pub gated_rows: usize,
    pub half_sums_in_f32: bool,
    pub most_summing_units: usize,
}

/// Units per cube, at most, of the kernels that sum over runs of rows, one unit per column
/// ([`RowRuns`]; the tests lower it for two of them, see [`Knobs`]).
pub(crate) const MOST_SUMMING_UNITS: usize = 256;

impl Default for Knobs {
    fn default() -> Self {
        Self {
            row_group: ROW_GROUP,
            row_gradient_batch: ROW_GRADIENT_BATCH,
            tile_units: MOST_TILE_THREADS,
            tile_padding: TilePadding::Vector,
            weights_product: ProductPath::Kernel {
                rows_per_step: PRODUCT_ROWS_PER_STEP,
            },
            table_projection: ProjectionPath::Tiles,
            gated_weights: GatedWeights::Direct,
            gated_rows: 1,
            half_sums_in_f32: true,
            most_summing_units: MOST_SUMMING_UNITS,
        }
    }
}

impl Knobs {
    /// The defaults, with each variable that is set to a valid value in its place.
    fn from_env() -> Self {
        Self::from_variables(|name| std::env::var(name).unwrap_or_default())
    }

    /// [`Knobs::from_env`] with `read` giving each variable's value (empty where unset).
    fn from_variables(read: impl Fn(&str) -> String) -> Self {
        let defaults = Self::default();
        let row_group = read("BURN_CONNECTIVITY_ROW_GROUP")
            .parse::<usize>()
            .ok()
            .filter(|group| group.is_power_of_two() && (2..=32).contains(group))
            .unwrap_or(defaults.row_group);
        let row_gradient_batch = read("BURN_CONNECTIVITY_ROW_GRADIENT_BATCH")
            .parse::<usize>()
            .ok()
            .filter(|batch| batch.is_power_of_two() && *batch <= 16)
            .unwrap_or(defaults.row_gradient_batch);
        let tile_units = read("BURN_CONNECTIVITY_TILE_UNITS")
            .parse::<usize>()
            .ok()
            .filter(|units| units.is_power_of_two() && (32..=1024).contains(units))
            .unwrap_or(defaults.tile_units);
        let tile_padding = match read("BURN_CONNECTIVITY_TILE_PADDING").as_str() {
            "odd" => TilePadding::Odd,
            _ => defaults.tile_padding,
        };
        let product = read("BURN_CONNECTIVITY_WEIGHTS_PRODUCT");
        let weights_product = match product.as_str() {
            "matmul" => ProductPath::Matmul,
            rows => rows
                .parse::<usize>()
                .ok()
                .filter(|rows| rows.is_power_of_two() && *rows <= 16)
                .map_or(defaults.weights_product, |rows_per_step| {
                    ProductPath::Kernel { rows_per_step }
                }),
        };
        let table_projection = match read("BURN_CONNECTIVITY_TABLE_PROJECTION").as_str() {
            "matmul" => ProjectionPath::Matmul,
            _ => defaults.table_projection,
        };
        let gated_weights = match read("BURN_CONNECTIVITY_GATED_WEIGHTS").as_str() {
            "staged" => GatedWeights::Staged,
            _ => defaults.gated_weights,
        };
        let gated_rows = read("BURN_CONNECTIVITY_GATED_ROWS")
            .parse::<usize>()
            .ok()
            .filter(|rows| rows.is_power_of_two() && *rows <= 8)
            .unwrap_or(defaults.gated_rows);
        Self {
            row_group,
            row_gradient_batch,
            tile_units,
            tile_padding,
            weights_product,
            table_projection,
            gated_weights,
            gated_rows,
            ..defaults
        }
    }
}

/// The knobs [`with_each_knobs`] puts in place, and the lock that holds one such test at a time.
#[cfg(test)]
static TEST_KNOBS: std::sync::Mutex<Option<Knobs>> = std::sync::Mutex::new(None);
#[cfg(test)]
static TEST_KNOBS_HELD: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The knobs of this process (see [`Knobs`]).
pub(crate) fn knobs() -> Knobs {
    #[cfg(test)]
    if let Some(knobs) = *TEST_KNOBS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        return knobs;
    }
    static KNOBS: std::sync::OnceLock<Knobs> = std::sync::OnceLock::new();
    *KNOBS.get_or_init(Knobs::from_env)
}

/// Runs `run` with each of `each` in place of the process's knobs in turn, then restores them,
/// also on a panic; one such test at a time, for all of its runs.
///
/// Process-wide, not per thread: a device's kernels are launched from its runner thread, not the
/// test's. `run` must read back what it checks, so that its kernels run before the knobs change.
/// Other tests that run meanwhile get the same knobs: the forms compute the same values, and
/// only these tests launch kernels in f16 (where `half_sums_in_f32` matters).
#[cfg(test)]
pub(crate) fn with_each_knobs<R, const N: usize>(
    each: [Knobs; N],
    mut run: impl FnMut() -> R,
) -> [R; N] {
    struct Restore;
    impl Drop for Restore {
        fn drop(&mut self) {
            *TEST_KNOBS
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = None;
        }
    }
    let _held = TEST_KNOBS_HELD
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let _restore = Restore;
    each.map(|knobs| {
        *TEST_KNOBS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(knobs);
        run()
    })
}

/// Units per cube of the tiled row kernels (at most; the `tile_units` knob, [`Knobs`]): twice a
/// tile's entries, so that 32 rows of mHC's table share each tile of `Φ` rather than 16, and
/// the cubes read `Φ` half as often in all (the form before, 128, is the knob's; not yet
/// measured on a GPU).
const MOST_TILE_THREADS: usize = 256;

/// Entries of `w` a weight tile of the tiled row kernels holds (at most; fewer in a smaller cube).
const MOST_TILE_ENTRIES: usize = 128;

/// How far apart a weight tile's entries `W[j, ·]` lie in shared memory (see [`RowTiles`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TilePadding {
    /// `C | 1`: the 8 entries a warp's row groups read at once lie in distinct banks.
    Odd,
    /// For 4-byte entries and `C ≥ 4`, `4 · (⌈C / 4⌉ | 1)` (28 for mHC's 24): each entry starts
    /// 16-byte aligned, so a unit's `C` reads of one entry can be 128-bit loads (ptxas makes
    /// `LDS.128` of them where it sees the alignment), and 8 entries, 4 banks each, still fall
    /// in distinct banks. Otherwise as `Odd`.
    Vector,
}

/// The distance between a weight tile's entries: `C` columns of `element`-byte entries.
pub(crate) fn tile_padding(columns: usize, element: usize, padding: TilePadding) -> usize {
    match padding {
        TilePadding::Vector if element == 4 && columns >= 4 => 4 * (columns.div_ceil(4) | 1),
        _ => columns | 1,
    }
}

/// The launch of a kernel that projects several rows of `x [R, w]` per cube through a
/// `[w, C]` weight matrix read in tiles: `threads` units, `group` of them per row, so
/// `rows_per_cube = threads / group` rows share each tile of `entries` entries of `w` (all
/// `threads` units load it), held in shared memory `padded` apart (see [`tile_padding`]). Each
/// unit takes `entries / group` entries of its row a tile.
///
/// Per row, the weights cost one pass over `w·C` values; a cube per row made every row stream
/// the whole matrix again (24× the row's own bytes for mHC's `C = 24`). Per cube they are read
/// in full once: `R / rows_per_cube` reads of `W` in all (151 MB for mHC's forward at the model
/// workload, 16 rows a cube), which the fifth lease's times followed (more units a row, fewer
/// rows a cube: slower in proportion, BENCHMARKS.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct RowTiles {
    pub threads: usize,
    pub group: usize,
    pub entries: usize,
    pub padded: usize,
    /// Entries of the shared buffer that holds the tile, then the per-unit sums.
    pub shared: usize,
    /// Entries of a unit's row whose loads [`tiled_row_gradient`](kernels::tiled_row_gradient)
    /// issues together (the `row_gradient_batch` knob, at most `entries / group`: both powers
    /// of two, so it divides them).
    pub batch: usize,
}

impl RowTiles {
    /// The largest cube (a power of two, up to the `tile_units` knob) whose tile, `slots`
    /// partial sums per unit and `per_row` more entries per row fit the shared memory.
    pub(crate) fn new(like: &CubeTensor, columns: usize, slots: usize, per_row: usize) -> Self {
        let hardware = &like.client.properties().hardware;
        Self::on(hardware, like.dtype.size(), columns, slots, per_row)
    }

    /// [`RowTiles::new`] for a device's `hardware` and tensors of `element_bytes` a value.
    pub(crate) fn on(
        hardware: &HardwareProperties,
        element_bytes: usize,
        columns: usize,
        slots: usize,
        per_row: usize,
    ) -> Self {
        let element = element_bytes.max(4);
        let device_bytes = match hardware.max_shared_memory_size {
            0 => TILE_SHARED_BYTES,
            bytes => bytes,
        };
        let budget = TILE_SHARED_BYTES.min(device_bytes) / element;
        let padded = tile_padding(columns, element, knobs().tile_padding);
        let most = knobs()
            .tile_units
            .min(hardware.max_units_per_cube as usize)
            .max(1);
        let mut threads = 1 << most.ilog2();
        loop {
            let group = knobs().row_group.min(threads);
            let entries = threads.min(MOST_TILE_ENTRIES);
            let tiles = Self {
                threads,
                group,
                entries,
                padded,
                shared: (entries * padded).max(threads * slots),
                batch: knobs().row_gradient_batch.min(entries / group),
            };
            if tiles.shared + tiles.rows_per_cube() * per_row <= budget || threads == 1 {
                return tiles;
            }
            threads /= 2;
        }
    }

    /// Rows per cube: `threads / group`.
    pub(crate) fn rows_per_cube(&self) -> usize {
        self.threads / self.group
    }

    /// The cubes for `rows` rows.
    pub(crate) fn launch(&self, like: &CubeTensor, rows: usize) -> (CubeCount, CubeDim) {
        per_item(like, rows.div_ceil(self.rows_per_cube()), self.threads)
    }
}

/// The most cubes of a grid-stride loop that writes one row of partial sums per cube (summed
/// afterwards by [`column_sums`]).
const MOST_CUBES: usize = 1024;

/// Elements per unit (at least) of such a loop.
const ELEMENTS_PER_UNIT: usize = 4;

/// `(threads, cubes)` of a grid-stride loop over `len` elements with `slots` partial sums per
/// unit: a full cube size where the sums fit, enough cubes for a few elements per unit.
pub(crate) fn grid_stride(like: &CubeTensor, len: usize, slots: usize) -> (usize, usize) {
    let threads = threads_for(like, slots, 256);
    let cubes = len
        .div_ceil(threads * ELEMENTS_PER_UNIT)
        .clamp(1, MOST_CUBES);
    (threads, cubes)
}

/// `Σ_c partials[c, k]` for every column `k` of `partials [cubes, K]`, stored in `dtype`'s
/// summing type ([`summing_dtype`]): `[K]` in `dtype`, one small kernel.
pub(crate) fn column_sums(partials: CubeTensor, dtype: DType) -> CubeTensor {
    assert_eq!(
        partials.dtype,
        summing_dtype(dtype),
        "partial sums are stored in the summing type"
    );
    let columns = partials.meta.shape()[1];
    let sums = empty_device_contiguous_dtype(
        partials.client.clone(),
        partials.device.clone(),
        Shape::new([columns]),
        dtype,
    );
    let (count, dim) = per_element(&partials, columns);
    kernels::column_sums_kernel::launch(
        &partials.client,
        count,
        dim,
        partials.clone().into_tensor_arg(),
        sums.clone().into_tensor_arg(),
        float_types(dtype),
    );
    sums
}

/// Cubes that a [`RowRuns`] sum spreads its rows over (about): enough to fill a large GPU.
const PRODUCT_CUBES: usize = 512;

/// Rows a cube of a [`RowRuns`] sum takes at least.
const PRODUCT_ROWS: usize = 32;

/// The launch of sums over the rows of a `[R, w]` tensor in runs of rows, one unit per column
/// (consecutive units reading consecutive columns): cube `chunk · column_cubes + j` takes
/// columns `j · threads ..` of rows `chunk · chunk_rows ..` and writes row `chunk` of a table
/// of partial sums. The kernel takes the cube's linear position (the grid may spread over its
/// axes) and stops the cubes past the last chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowRuns {
    pub threads: usize,
    pub column_cubes: usize,
    pub chunk_rows: usize,
    pub chunks: usize,
}

impl RowRuns {
    /// Runs over `rows` rows of `width` columns on `like`'s device, at most `most` units a cube.
    pub(crate) fn new(like: &CubeTensor, rows: usize, width: usize, most: usize) -> Self {
        let hardware = &like.client.properties().hardware;
        Self::on(hardware, rows, width, most)
    }

    /// [`RowRuns::new`] for a device's `hardware`.
    pub(crate) fn on(
        hardware: &HardwareProperties,
        rows: usize,
        width: usize,
        most: usize,
    ) -> Self {
        let threads = width
            .next_power_of_two()
            .min(most)
            .min(hardware.max_units_per_cube as usize)
            .max(1);
        let column_cubes = width.div_ceil(threads);
        let chunk_rows = rows
            .div_ceil((PRODUCT_CUBES / column_cubes).max(1))
            .max(PRODUCT_ROWS);
        let chunks = rows.div_ceil(chunk_rows).max(1);
        Self {
            threads,
            column_cubes,
            chunk_rows,
            chunks,
        }
    }

    /// The cubes of every run.
    pub(crate) fn launch(&self, like: &CubeTensor) -> (CubeCount, CubeDim) {
        per_item(like, self.column_cubes * self.chunks, self.threads)
    }
}

/// `xᵀ (s ⊙ δ)` for `rows [R, w]` and `scaled_grad [R, C]`, the gradient of a projection's
/// weights (`[w, C]`, `C` a few dozen at most), summed as [`float_types`] says.
///
/// Each cube takes a run of rows and `CUBE_DIM` columns of `x`, one unit per column (the reads of
/// `x` coalesced, each row of `s ⊙ δ` read by every unit alike), and writes its partial sums as
/// one row of a `[chunks, w · C]` table that [`column_sums`] reduces: two kernels. A unit's loop
/// takes [`PRODUCT_ROWS_PER_STEP`] rows per step, their loads first: one row per step left each
/// unit with one row's loads in flight at a time. Burn's matmul took this skinny product before
/// (a swapped `[w, R]` view times `[R, C]`): on an H100 through CUDA that took 1.4 ms per block of HC's
/// train step at `R = 32768, w = 768, C = 5` (the residual's whole block: 4.9 ms), 0.13 ms for
/// mHC's `R = 8192, w = 3072, C = 24`, where this kernel with one row per step takes 0.25 ms on
/// an H200. `BURN_CONNECTIVITY_WEIGHTS_PRODUCT` picks the matmul or the rows per step, to
/// measure the forms on one GPU ([`Knobs`]).
pub(crate) fn weights_product(rows: CubeTensor, scaled_grad: CubeTensor) -> CubeTensor {
    if knobs().weights_product == ProductPath::Matmul {
        return Cube::float_matmul(Cube::float_swap_dims(rows, 0, 1), scaled_grad);
    }
    let dtype = rows.dtype;
    let width = rows.meta.shape()[1];
    let columns = scaled_grad.meta.shape()[1];
    let sums = column_sums(weights_product_partials(rows, scaled_grad), dtype);
    Cube::float_reshape(sums, Shape::new([width, columns]))
}

/// [`weights_product`] as partial sums `[chunks, w · C]` in the summing type
/// ([`summing_dtype`]), whose sum over the chunks is the product: for a kernel that takes the
/// product on and sums the chunks itself, in place of [`column_sums`]' launch. (Through Burn's
/// matmul, the product itself as one chunk.)
pub(crate) fn weights_product_partials(rows: CubeTensor, scaled_grad: CubeTensor) -> CubeTensor {
    let [count, width] = rows.meta.shape().dims::<2>();
    let columns = scaled_grad.meta.shape()[1];
    let rows_per_step = match knobs().weights_product {
        ProductPath::Matmul => {
            let summing = summing_dtype(rows.dtype);
            let product = Cube::float_matmul(Cube::float_swap_dims(rows, 0, 1), scaled_grad);
            let product = if product.dtype == summing {
                product
            } else {
                Cube::float_cast(product, summing.into())
            };
            return Cube::float_reshape(into_contiguous(product), Shape::new([1, width * columns]));
        }
        ProductPath::Kernel { rows_per_step } => rows_per_step,
    };
    let rows = into_contiguous(rows);
    let scaled_grad = into_contiguous(scaled_grad);
    let runs = RowRuns::new(&rows, count, width, knobs().most_summing_units);
    let partials = empty_partials(&rows, Shape::new([runs.chunks, width * columns]));
    // Past 65535 cubes at rows of 16.7M entries (see `RowRuns`).
    let (launch_cubes, dim) = runs.launch(&rows);
    kernels::weights_product_kernel::launch(
        &rows.client,
        launch_cubes,
        dim,
        rows.clone().into_tensor_arg(),
        scaled_grad.into_tensor_arg(),
        partials.clone().into_tensor_arg(),
        runs.chunk_rows,
        columns,
        runs.column_cubes,
        rows_per_step,
        runs.threads,
        float_types(rows.dtype),
    );
    partials
}

/// `(rows, width)` of a `[..., width]` tensor: its last axis and the rows before it.
pub(crate) fn rows_and_width(tensor: &CubeTensor) -> (usize, usize) {
    let shape = tensor.meta.shape();
    let width = shape[shape.num_dims() - 1];
    (shape.num_elements() / width.max(1), width)
}

/// An uninitialised contiguous tensor of `shape` on `like`'s device, of its float type.
pub(crate) fn empty(like: &CubeTensor, shape: Shape) -> CubeTensor {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, like.dtype)
}

/// The fusion metadata of a `[1]` placeholder of `like`'s float type: what an op's backward
/// returns for a gradient nobody wants.
pub(crate) fn placeholder_spec(
    like: &burn::backend::fusion::custom::TensorSpec,
) -> burn::backend::fusion::custom::TensorSpec {
    burn::backend::fusion::custom::TensorSpec::new(Shape::new([1]), like.dtype)
}

/// The first `length` elements of row `row` of the contiguous `table [rows, W]`, as `[length]`:
/// a view where the row's byte offset suits the runtime's alignment (the callers make rows a
/// multiple of [`ALIGNED_BYTES`](crate::backend::ALIGNED_BYTES)), else a copy (one small
/// kernel).
pub(crate) fn row_prefix(table: CubeTensor, row: usize, length: usize) -> CubeTensor {
    let table = into_contiguous(table);
    let width = table.meta.shape()[1];
    let offset = (row * width * table.dtype.size()) as u64;
    if offset.is_multiple_of(table.client.properties().memory.alignment) {
        let handle = table.handle.clone().offset_start(offset);
        return CubeTensor::new_contiguous(
            table.client.clone(),
            table.device.clone(),
            Shape::new([length]),
            handle,
            table.dtype,
        );
    }
    let part = burn_cubecl::kernel::slice(table, &[row..row + 1, 0..length]);
    Cube::float_reshape(part, Shape::new([length]))
}

/// The CubeCL backend every runtime shares.
pub(crate) type Cube = CubeBackend;

pub(crate) mod kernels {
    use cubecl::prelude::*;

    use super::RowTiles;

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

    /// `Σ value` over the units of the cube, through `shared` (at least one entry per unit;
    /// free again on return).
    #[cube]
    pub(crate) fn cube_total<E: Float>(value: E, shared: &mut Shared<[E]>) -> E {
        shared[UNIT_POS as usize] = value;
        sync_cube();
        sum_over_cube::<E>(shared, 1usize);
        let total = shared[0];
        sync_cube();
        total
    }

    /// [`cube_total`] of two values at once (two entries per unit).
    #[cube]
    pub(crate) fn cube_totals<E: Float>(first: E, second: E, shared: &mut Shared<[E]>) -> (E, E) {
        let unit = UNIT_POS as usize;
        shared[2 * unit] = first;
        shared[2 * unit + 1] = second;
        sync_cube();
        sum_over_cube::<E>(shared, 2usize);
        let totals = (shared[0], shared[1]);
        sync_cube();
        totals
    }

    /// An `f32` constant passed as its bits.
    #[cube]
    pub(crate) fn constant<E: Float>(#[comptime] bits: u32) -> E {
        E::new(comptime!(f32::from_bits(bits)))
    }

    /// `ρ = √(n² + c)` of a row from its sum of squares `n²` (`c` as the bits of an `f32`; with
    /// `c = 0`, the row's norm): what [`row_scale`] and [`row_slope`] take.
    #[cube]
    pub(crate) fn row_root<E: Float>(squares: E, #[comptime] root_offset_bits: u32) -> E {
        let mut root = squares.sqrt();
        if comptime!(root_offset_bits != 0) {
            root = (squares + constant::<E>(root_offset_bits)).sqrt();
        }
        root
    }

    /// `s(n) = a / max(ρ + b, f)` with `ρ = √(n² + c)` ([`row_root`]), the constants as the bits
    /// of `f32`s (with `f = 0` the floor is left out). The floor replaces the denominator
    /// rather than dividing `a` itself: a floor that the type rounds to 0 (HC's 1e-12 in f16)
    /// would fold `a / f` into an infinite constant that WGSL cannot write.
    #[cube]
    pub(crate) fn row_scale<E: Float>(
        root: E,
        #[comptime] numerator_bits: u32,
        #[comptime] offset_bits: u32,
        #[comptime] floor_bits: u32,
    ) -> E {
        let mut denominator = root + constant::<E>(offset_bits);
        if comptime!(floor_bits != 0) {
            let floor = constant::<E>(floor_bits);
            if denominator <= floor {
                denominator = floor;
            }
        }
        constant::<E>(numerator_bits) / denominator
    }

    /// `s'(n) / n = −s / (ρ + b) / ρ`: 0 where `s` is flat and for a zero root (a zero row
    /// with `c = 0`, whose term vanishes).
    #[cube]
    pub(crate) fn row_slope<E: Float>(
        root: E,
        scale: E,
        #[comptime] offset_bits: u32,
        #[comptime] floor_bits: u32,
    ) -> E {
        let denominator = root + constant::<E>(offset_bits);
        let mut slope = E::new(0.0);
        let mut steep = root > E::new(0.0);
        if comptime!(floor_bits != 0) {
            steep = steep && denominator > constant::<E>(floor_bits);
        }
        if steep {
            slope = E::new(0.0) - scale / denominator / root;
        }
        slope
    }

    /// Entry `[j, c]` of `weights [w, columns]`: at `j · columns + c` where they are contiguous,
    /// else through their strides (a transposed view, `Fᵀ` of a stored `F`, read as it is).
    #[cube]
    #[allow(unused_assignments)] // the comptime branch overwrites the placeholder
    pub(crate) fn weight_at<E: Float>(
        weights: &Tensor<E>,
        j: usize,
        c: usize,
        #[comptime] columns: usize,
        #[comptime] contiguous: bool,
    ) -> E {
        let mut value = E::new(0.0);
        if comptime!(contiguous) {
            value = weights[j * columns + c];
        } else {
            value = weights[j * weights.stride(0) + c * weights.stride(1)];
        }
        value
    }

    /// Entries `start .. start + entries` of `weights [w, columns]` (any strides: `contiguous`
    /// says whether they are `[columns, 1]`) into `tile`, `padded` apart, zero past `w`. The
    /// units read consecutive addresses in either layout. The cube must have `threads` units
    /// (every caller launches it so), at least `entries`.
    ///
    /// The tile has `entries · columns` values, so each unit loads `⌈entries · columns /
    /// threads⌉` of them (`columns` where `entries = threads`), all issued before the first is
    /// stored: a loop of load-then-store pairs waits one load's
    /// latency per entry (24 a tile for mHC) unless the GPU's compiler unrolls it, and the
    /// tiled row kernels' few rows per cube leave a GPU few other units to hide it with.
    #[cube]
    pub(crate) fn load_weight_tile<E: Float, A: Float>(
        weights: &Tensor<E>,
        start: usize,
        tile: &mut Shared<[A]>,
        #[comptime] columns: usize,
        #[comptime] threads: usize,
        #[comptime] entries: usize,
        #[comptime] padded: usize,
        #[comptime] contiguous: bool,
    ) {
        let width = weights.shape(0);
        let unit = UNIT_POS as usize;
        let values_len = comptime!(entries * columns);
        let loads = comptime!(values_len.div_ceil(threads));
        // Whether the last load's index may pass the tile (never where `entries = threads`).
        let ragged = comptime!(!values_len.is_multiple_of(threads));
        let mut values = Array::<A>::new(loads);
        #[unroll]
        for i in 0..loads {
            let (entry, c) = tile_place(unit, i, columns, threads, entries, contiguous);
            let j = start + entry;
            let mut value = A::new(0.0);
            let mut inside = j < width;
            if comptime!(ragged) {
                inside = inside && unit + comptime!(i * threads) < values_len;
            }
            if inside {
                value = A::cast_from(weight_at::<E>(weights, j, c, columns, contiguous));
            }
            values[i] = value;
        }
        #[unroll]
        for i in 0..loads {
            let (entry, c) = tile_place(unit, i, columns, threads, entries, contiguous);
            let mut inside = true;
            if comptime!(ragged) {
                inside = unit + comptime!(i * threads) < values_len;
            }
            if inside {
                tile[entry * padded + c] = values[i];
            }
        }
    }

    /// `(entry, column)` of load `i` of `unit` in [`load_weight_tile`]: index `unit + i ·
    /// threads` of the tile (`entries · columns` values) in the weights' own order, so that
    /// consecutive units read consecutive addresses.
    #[cube]
    fn tile_place(
        unit: usize,
        #[comptime] i: usize,
        #[comptime] columns: usize,
        #[comptime] threads: usize,
        #[comptime] entries: usize,
        #[comptime] contiguous: bool,
    ) -> (usize, usize) {
        let index = unit + comptime!(i * threads);
        let mut entry = index % entries;
        let mut c = index / entries;
        if comptime!(contiguous) {
            entry = index / columns;
            c = index % columns;
        }
        (entry, c)
    }

    /// The unit's entries `start + in_group + e · group` (`e < entries / group`) of its row of
    /// `rows [R, width]`, zero past `width` or for a row past the last, into `xs`.
    ///
    /// All are loaded before any is used, so a unit has them in flight together: a cube's few
    /// rows give a GPU few units to hide a load's latency with. On an H200 this took the
    /// normalised table's forward kernel from 0.35 to 0.29 ms per block (BENCHMARKS.md); the
    /// same prefetch in the row gradient's pass, which also reads the previous gradient and
    /// the block input's, made that kernel slower (0.75 to 1.13 ms), so it has none.
    #[cube]
    pub(crate) fn row_entries<E: Float, A: Float>(
        rows: &Tensor<E>,
        width: usize,
        row: usize,
        live: bool,
        start: usize,
        xs: &mut Array<A>,
        #[comptime] tiles: RowTiles,
    ) {
        let group = comptime!(tiles.group);
        let in_group = UNIT_POS as usize % group;
        #[unroll]
        for e in 0..comptime!(tiles.entries / group) {
            let j = start + in_group + e * group;
            let mut x = A::new(0.0);
            if live && j < width {
                x = A::cast_from(rows[row * width + j]);
            }
            xs[e] = x;
        }
    }

    /// For the cube's rows `first + r` of `rows [R, w]` (`r < threads / group`, `group`
    /// consecutive units each): `x W` (`columns` entries, `W [w, columns]` read in tiles of
    /// `entries` entries of `w`, see [`RowTiles`](super::RowTiles)), then `‖x‖²`. Row `r`'s
    /// `columns + 1` totals end at `shared[r · group · (columns + 1)]` (the tile shares the
    /// buffer: `shared` entries of it).
    #[cube]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn tiled_projection<E: Float, A: Float>(
        rows: &Tensor<E>,
        weights: &Tensor<E>,
        first: usize,
        shared: &mut Shared<[A]>,
        #[comptime] columns: usize,
        #[comptime] tiles: RowTiles,
        #[comptime] contiguous: bool,
    ) {
        let threads = comptime!(tiles.threads);
        let group = comptime!(tiles.group);
        let padded = comptime!(tiles.padded);
        let width = rows.shape(1);
        let unit = UNIT_POS as usize;
        let slots = comptime!(columns + 1);
        let in_group = unit % group;
        let row = first + unit / group;
        let live = row < rows.shape(0);
        // Unrolled: the partial sums stay in registers.
        let mut partial = Array::<A>::new(slots);
        #[unroll]
        for s in 0..slots {
            partial[s] = A::new(0.0);
        }
        let entries = comptime!(tiles.entries);
        let per_unit = comptime!(entries / group);
        let mut xs = Array::<A>::new(per_unit);
        let mut start = 0usize;
        while start < width {
            row_entries::<E, A>(rows, width, row, live, start, &mut xs, tiles);
            load_weight_tile::<E, A>(
                weights, start, shared, columns, threads, entries, padded, contiguous,
            );
            sync_cube();
            if live {
                #[unroll]
                for e in 0..per_unit {
                    let entry = in_group + e * group;
                    let x = xs[e];
                    #[unroll]
                    for c in 0..columns {
                        partial[c] += x * shared[entry * padded + c];
                    }
                    partial[columns] += x * x;
                }
            }
            sync_cube();
            start += entries;
        }
        #[unroll]
        for s in 0..slots {
            shared[unit * slots + s] = partial[s];
        }
        sync_cube();
        // Each (row, slot) total summed by one unit into its group's first entry, which only
        // that unit reads.
        let count = comptime!(threads / group * slots);
        let mut index = unit;
        while index < count {
            let at = (index / slots) * comptime!(group * slots) + index % slots;
            let mut total = shared[at];
            #[unroll]
            for g in 1..group {
                total += shared[at + g * slots];
            }
            shared[at] = total;
            index += threads;
        }
        sync_cube();
    }

    /// `‖x_r‖²` of the unit's row `r` of the cube's rows (as in [`tiled_projection`], without
    /// weights): each unit of the row's group sums every `group`-th square, each adds its
    /// group's sums from `shared` (`threads` entries used). The tiled form with no columns
    /// passed the tiles with two cube syncs each; this has two in all.
    #[cube]
    pub(crate) fn row_squares<E: Float, A: Float>(
        rows: &Tensor<E>,
        first: usize,
        shared: &mut Shared<[A]>,
        #[comptime] tiles: RowTiles,
    ) -> A {
        let group = comptime!(tiles.group);
        let width = rows.shape(1);
        let unit = UNIT_POS as usize;
        let row = first + unit / group;
        let live = row < rows.shape(0);
        let mut partial = A::new(0.0);
        let mut xs = Array::<A>::new(comptime!(tiles.entries / group));
        let mut start = 0usize;
        while start < width {
            row_entries::<E, A>(rows, width, row, live, start, &mut xs, tiles);
            #[unroll]
            for e in 0..comptime!(tiles.entries / group) {
                partial += xs[e] * xs[e];
            }
            start += comptime!(tiles.entries);
        }
        shared[unit] = partial;
        sync_cube();
        let base = unit - unit % group;
        let mut total = shared[base];
        #[unroll]
        for g in 1..group {
            total += shared[base + g];
        }
        // The caller reuses the buffer.
        sync_cube();
        total
    }

    /// `⟨x[k], other[r]⟩` for the `views` equal parts `x[k]` of the cube's rows `first + r` of
    /// `rows [R, w]` (as in [`tiled_projection`], without weights) with the rows of
    /// `other [R, w / views]`: unit `r < threads / group` gets its row `first + r`'s totals in
    /// `totals` (`threads · views` entries of `shared` used, free again on return). Each unit of a
    /// row's group takes every `group`-th entry of `other`'s row and the `views` entries of the
    /// row it multiplies.
    #[cube]
    pub(crate) fn row_view_products<E: Float, A: Float>(
        rows: &Tensor<E>,
        other: &Tensor<E>,
        first: usize,
        shared: &mut Shared<[A]>,
        totals: &mut Array<A>,
        #[comptime] views: usize,
        #[comptime] tiles: RowTiles,
    ) {
        let group = comptime!(tiles.group);
        let unit = UNIT_POS as usize;
        let row = first + unit / group;
        let width = rows.shape(1);
        let view_width = width / views;
        let mut partial = Array::<A>::new(views);
        #[unroll]
        for k in 0..views {
            partial[k] = A::new(0.0);
        }
        if row < rows.shape(0) {
            let mut j = unit % group;
            while j < view_width {
                let o = A::cast_from(other[row * view_width + j]);
                #[unroll]
                for k in 0..views {
                    partial[k] += A::cast_from(rows[row * width + k * view_width + j]) * o;
                }
                j += group;
            }
        }
        #[unroll]
        for k in 0..views {
            shared[unit * views + k] = partial[k];
        }
        sync_cube();
        #[unroll]
        for k in 0..views {
            totals[k] = A::new(0.0);
        }
        if unit < comptime!(tiles.threads / group) {
            #[unroll]
            for k in 0..views {
                let mut total = A::new(0.0);
                #[unroll]
                for g in 0..group {
                    total += shared[(unit * group + g) * views + k];
                }
                totals[k] = total;
            }
        }
        sync_cube();
    }

    /// `∂x` of the cube's rows (as in [`tiled_projection`]) in one pass over the weight tiles:
    /// `∂x[j] = scale · Σ_c W[j, c] step[c] + along · x[j]`, plus `previous[j]` with
    /// `with_previous`, plus `gains[k] · other[row, j mod (w / views)]` on the row's part `k`
    /// with `views > 0` (`step`, `scale`, `along` and `gains` the unit's row's).
    #[cube]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn tiled_row_gradient<E: Float, A: Float>(
        rows: &Tensor<E>,
        weights: &Tensor<E>,
        previous: &Tensor<E>,
        other: &Tensor<E>,
        grad_rows: &mut Tensor<E>,
        first: usize,
        shared: &mut Shared<[A]>,
        step: &Array<A>,
        scale: A,
        along: A,
        gains: &Array<A>,
        #[comptime] columns: usize,
        #[comptime] views: usize,
        #[comptime] with_previous: bool,
        #[comptime] tiles: RowTiles,
        #[comptime] contiguous: bool,
    ) {
        let threads = comptime!(tiles.threads);
        let group = comptime!(tiles.group);
        let padded = comptime!(tiles.padded);
        let width = rows.shape(1);
        let unit = UNIT_POS as usize;
        let in_group = unit % group;
        let row = first + unit / group;
        let live = row < rows.shape(0);
        let view_width = width / comptime!(views.max(1));
        let batch = comptime!(tiles.batch);
        let entries = comptime!(tiles.entries);
        let mut start = 0usize;
        while start < width {
            load_weight_tile::<E, A>(
                weights, start, shared, columns, threads, entries, padded, contiguous,
            );
            sync_cube();
            if live {
                // The unit's entries `in_group + e · group` in batches, each batch's loads
                // issued before its products (one entry at a time, each entry waited for its
                // three loads in turn).
                for first_entry in 0..comptime!(entries / group / batch) {
                    let mut xs = Array::<A>::new(batch);
                    let mut earlier = Array::<A>::new(batch);
                    let mut added = Array::<A>::new(batch);
                    #[unroll]
                    for e in 0..batch {
                        let j = start + in_group + (first_entry * batch + e) * group;
                        let mut x = A::new(0.0);
                        let mut before = A::new(0.0);
                        let mut term = A::new(0.0);
                        if j < width {
                            let at = row * width + j;
                            x = A::cast_from(rows[at]);
                            if comptime!(with_previous) {
                                before = A::cast_from(previous[at]);
                            }
                            if comptime!(views > 0) {
                                // Part k of the row starts at k · view_width: comparisons,
                                // not a division by a width known only at run time.
                                let mut gain = gains[0];
                                let mut offset = j;
                                #[unroll]
                                for k in 1..views {
                                    if j >= k * view_width {
                                        gain = gains[k];
                                        offset = j - k * view_width;
                                    }
                                }
                                term = gain * A::cast_from(other[row * view_width + offset]);
                            }
                        }
                        xs[e] = x;
                        earlier[e] = before;
                        added[e] = term;
                    }
                    #[unroll]
                    for e in 0..batch {
                        let entry = in_group + (first_entry * batch + e) * group;
                        let j = start + entry;
                        if j < width {
                            let mut value = scale
                                * tile_dot::<A>(&*shared, entry, step, columns, padded)
                                + along * xs[e];
                            if comptime!(with_previous) {
                                value += earlier[e];
                            }
                            if comptime!(views > 0) {
                                value += added[e];
                            }
                            grad_rows[row * width + j] = E::cast_from(value);
                        }
                    }
                }
            }
            sync_cube();
            start += entries;
        }
    }

    /// `Σ_c W[start + entry, c] · step[c]` from the tile [`load_weight_tile`] holds.
    #[cube]
    pub(crate) fn tile_dot<E: Float>(
        tile: &Shared<[E]>,
        entry: usize,
        step: &Array<E>,
        #[comptime] columns: usize,
        #[comptime] padded: usize,
    ) -> E {
        let mut total = E::new(0.0);
        #[unroll]
        for c in 0..columns {
            total += tile[entry * padded + c] * step[c];
        }
        total
    }

    /// `staged[i] = from[start + i]` for `i < len` (at most `most`), the cube's `threads` units
    /// taking consecutive entries.
    #[cube]
    fn stage_rows<E: Float, A: Float>(
        from: &Tensor<E>,
        start: usize,
        len: usize,
        staged: &mut Shared<[A]>,
        #[comptime] most: usize,
        #[comptime] threads: usize,
    ) {
        let unit = UNIT_POS as usize;
        #[unroll]
        for k in 0..comptime!(most.div_ceil(threads)) {
            let i = unit + comptime!(k * threads);
            if i < len {
                staged[i] = A::cast_from(from[start + i]);
            }
        }
    }

    /// Rows `chunk · k .. (chunk + 1) · k` (`k = chunk_rows`) and one unit per column `j` of
    /// `rows [R, w]`: `partials[chunk, j · C + c] = Σ_r rows[r, j] · scaled_grad[r, c]` over
    /// those rows, `rows_per_step` rows per step of the loop, loaded before any is used (see
    /// [`weights_product`](super::weights_product)).
    ///
    /// Every unit of a cube reads the same rows of `scaled_grad`: each step the cube copies the
    /// step's `rows_per_step · C` entries (contiguous) into shared memory, one load a unit, and
    /// the units read them there. Read from global memory, each multiply-add had a load of its
    /// own and, the index being a `u32` that may wrap, an add and a 64-bit address product
    /// before it (806 instructions a step for mHC's 192 multiply-adds on `sm_90a`,
    /// `tools/gpu/sass.sh`); from shared memory the offsets are constants in the loads.
    #[cube(launch)]
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn weights_product_kernel<E: Float, A: Float>(
        rows: &Tensor<E>,
        scaled_grad: &Tensor<E>,
        partials: &mut Tensor<A>,
        chunk_rows: usize,
        #[comptime] columns: usize,
        #[comptime] column_cubes: usize,
        #[comptime] rows_per_step: usize,
        #[comptime] threads: usize,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let cube = CUBE_POS;
        let chunk = cube / column_cubes;
        let unit = UNIT_POS as usize;
        let j = (cube % column_cubes) * threads + unit;
        let count = rows.shape(0);
        let width = rows.shape(1);
        // Whole cubes only: every unit takes part in the staging and its syncs.
        if chunk >= partials.shape(0) {
            terminate!();
        }
        let live = j < width;
        let first = chunk * chunk_rows;
        let mut last = first + chunk_rows;
        if last > count {
            last = count;
        }
        let step_len = comptime!(rows_per_step * columns);
        let mut staged = Shared::<[A]>::new_slice(step_len);
        let mut sums = Array::<A>::new(columns);
        #[unroll]
        for c in 0..columns {
            sums[c] = A::new(0.0);
        }
        let mut r = first;
        let mut xs = Array::<A>::new(rows_per_step);
        while r + rows_per_step <= last {
            stage_rows::<E, A>(
                scaled_grad,
                r * columns,
                step_len,
                &mut staged,
                step_len,
                threads,
            );
            if live {
                #[unroll]
                for u in 0..rows_per_step {
                    xs[u] = A::cast_from(rows[(r + u) * width + j]);
                }
            }
            sync_cube();
            if live {
                #[unroll]
                for u in 0..rows_per_step {
                    #[unroll]
                    for c in 0..columns {
                        sums[c] += xs[u] * staged[u * columns + c];
                    }
                }
            }
            sync_cube();
            r += rows_per_step;
        }
        // The last rows, fewer than a step.
        let tail = (last - r) * columns;
        stage_rows::<E, A>(
            scaled_grad,
            r * columns,
            tail,
            &mut staged,
            step_len,
            threads,
        );
        sync_cube();
        if live {
            let mut u = 0usize;
            while r + u < last {
                let x = A::cast_from(rows[(r + u) * width + j]);
                #[unroll]
                for c in 0..columns {
                    sums[c] += x * staged[u * columns + c];
                }
                u += 1;
            }
            let base = (chunk * width + j) * columns;
            #[unroll]
            for c in 0..columns {
                partials[base + c] = sums[c];
            }
        }
    }

    /// `sums[k] = Σ_c partials[c, k]`; one unit per column.
    #[cube(launch)]
    pub(crate) fn column_sums_kernel<E: Float, A: Float>(
        partials: &Tensor<A>,
        sums: &mut Tensor<E>,
        #[define(E, A)] _dtypes: [ElemType; 2],
    ) {
        let k = ABSOLUTE_POS;
        let columns = partials.shape(1);
        if k >= columns {
            terminate!();
        }
        let mut total = A::new(0.0);
        for c in 0..partials.shape(0) {
            total += partials[c * columns + k];
        }
        sums[k] = E::cast_from(total);
    }
}

/// The weights' gradient `xᵀ (s ⊙ δ)` of mHC's and HC's tables at the model workload (`tokens`
/// tokens of `n` units of `width`, f32), as [`weights_product_partials`] launches it with the
/// default knobs.
#[cfg(feature = "kernel-source")]
pub(crate) fn cuda_kernels(
    target: &super::kernel_source::Target,
    tokens: usize,
    n: usize,
    width: usize,
) -> Result<Vec<super::kernel_source::CudaKernel>, String> {
    use super::kernel_source::{F32, tensor};
    let ProductPath::Kernel { rows_per_step } = knobs().weights_product else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    // mHC: rows of `n · width`, `2n + n²` columns; HC: rows of `width` for each unit, `n + 2`.
    for (name, rows, row_width, columns) in [
        ("weights_product (mHC)", tokens, n * width, 2 * n + n * n),
        ("weights_product (HC)", tokens * n, width, n + 2),
    ] {
        let runs = RowRuns::on(
            target.hardware(),
            rows,
            row_width,
            knobs().most_summing_units,
        );
        let kernel = kernels::weights_product_kernel::WeightsProductKernel::new(
            target.settings(runs.threads),
            target.device(),
            target.runtime(),
            tensor(),
            tensor(),
            tensor(),
            (),
            columns,
            runs.column_cubes,
            rows_per_step,
            runs.threads,
            F32,
        );
        let case = format!("{rows} rows of {row_width}, {columns} columns, f32");
        let cubes = runs.column_cubes * runs.chunks;
        out.push(target.compile(name, &case, kernel, runs.threads, cubes)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::{GatedWeights, Knobs, ProductPath, ProjectionPath, TilePadding, tile_padding};

    /// The variables `tools/gpu/measure.sh` sets reach the knobs, and values out of range leave
    /// the defaults (a misread variable would have a lease time the default form twice).
    #[test]
    fn knobs_read_their_variables() {
        let read = |variables: &[(&str, &str)]| {
            Knobs::from_variables(|name| {
                variables
                    .iter()
                    .find(|(variable, _)| *variable == name)
                    .map_or_else(String::new, |(_, value)| value.to_string())
            })
        };
        assert_eq!(read(&[]), Knobs::default());
        let every = read(&[
            ("BURN_CONNECTIVITY_ROW_GROUP", "16"),
            ("BURN_CONNECTIVITY_ROW_GRADIENT_BATCH", "16"),
            ("BURN_CONNECTIVITY_TILE_UNITS", "512"),
            ("BURN_CONNECTIVITY_TILE_PADDING", "odd"),
            ("BURN_CONNECTIVITY_WEIGHTS_PRODUCT", "matmul"),
            ("BURN_CONNECTIVITY_TABLE_PROJECTION", "matmul"),
            ("BURN_CONNECTIVITY_GATED_WEIGHTS", "staged"),
            ("BURN_CONNECTIVITY_GATED_ROWS", "4"),
        ]);
        let expected = Knobs {
            row_group: 16,
            row_gradient_batch: 16,
            tile_units: 512,
            tile_padding: TilePadding::Odd,
            weights_product: ProductPath::Matmul,
            table_projection: ProjectionPath::Matmul,
            gated_weights: GatedWeights::Staged,
            gated_rows: 4,
            ..Knobs::default()
        };
        assert_eq!(every, expected);
        assert_eq!(
            read(&[("BURN_CONNECTIVITY_WEIGHTS_PRODUCT", "2")]).weights_product,
            ProductPath::Kernel { rows_per_step: 2 }
        );
        let out_of_range = read(&[
            ("BURN_CONNECTIVITY_ROW_GROUP", "1"),
            ("BURN_CONNECTIVITY_ROW_GRADIENT_BATCH", "3"),
            ("BURN_CONNECTIVITY_TILE_UNITS", "16"),
            ("BURN_CONNECTIVITY_TILE_PADDING", "even"),
            ("BURN_CONNECTIVITY_WEIGHTS_PRODUCT", "3"),
            ("BURN_CONNECTIVITY_TABLE_PROJECTION", "tile"),
            ("BURN_CONNECTIVITY_GATED_WEIGHTS", "shared"),
            ("BURN_CONNECTIVITY_GATED_ROWS", "16"),
        ]);
        assert_eq!(out_of_range, Knobs::default());
    }

    /// Vector padding starts every entry 16-byte aligned, and 8 consecutive entries (a warp's
    /// row groups at the default 8 units a row) start in distinct banks of 4; odd padding and
    /// 8-byte entries keep the odd distance.
    #[test]
    fn tile_padding_aligns_entries_in_distinct_banks() {
        for columns in 4..=80 {
            let padded = tile_padding(columns, 4, TilePadding::Vector);
            assert!(
                padded >= columns && padded.is_multiple_of(4),
                "C = {columns}: {padded}"
            );
            assert!(padded < columns + 8, "C = {columns}: {padded}");
            let mut banks: Vec<usize> = (0..8).map(|k| k * padded % 32).collect();
            banks.sort_unstable();
            banks.dedup();
            assert_eq!(banks.len(), 8, "C = {columns}: {padded}");
        }
        assert_eq!(tile_padding(24, 4, TilePadding::Vector), 28);
        assert_eq!(tile_padding(6, 4, TilePadding::Vector), 12);
        assert_eq!(tile_padding(3, 4, TilePadding::Vector), 3);
        assert_eq!(tile_padding(24, 8, TilePadding::Vector), 25);
        assert_eq!(tile_padding(24, 4, TilePadding::Odd), 25);
    }
}
