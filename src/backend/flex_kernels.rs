//! Helpers shared by the crate's fused CPU ops on Flex: typed views of Flex tensors and the
//! inner loops they are made of.

use std::borrow::Cow;
use std::mem::MaybeUninit;

use burn::tensor::TensorData;
use burn_flex::FlexTensor;

/// The scalar types the CPU ops run on (f32 and f64), with their two inner loops: portable
/// ones, and for f32 on x86-64 CPUs with AVX2 and FMA (which the crate's baseline target,
/// SSE2, lacks) hand-vectorised ones ([`avx2`]).
pub(crate) trait Scalar:
    burn::tensor::Element + bytemuck::Pod + num_traits::Float + std::ops::AddAssign + Send + Sync
{
    /// `Σ_k a_k b_k`.
    fn dot(a: &[Self], b: &[Self]) -> Self {
        portable_dot(a, b)
    }

    /// `out += c x`.
    fn axpy(out: &mut [Self], c: Self, x: &[Self]) {
        portable_axpy(out, c, x);
    }

    /// `out += Σ_i c_i x_i`.
    fn add_weighted_sum(out: &mut [Self], terms: &[(Self, &[Self])]) {
        portable_add_weighted_sum(out, terms);
    }

    /// `out = base + c x` (`c x` without a base), every element of `out` written.
    fn write_axpy(out: &mut [MaybeUninit<Self>], base: Option<&[Self]>, c: Self, x: &[Self]) {
        portable_write_axpy(out, base, c, x);
    }

    /// `out_i = ⟨a, x_i⟩`.
    fn dots(a: &[Self], xs: &[&[Self]], out: &mut [Self]) {
        for (out, x) in out.iter_mut().zip(xs) {
            *out = portable_dot(a, x);
        }
    }
}

impl Scalar for f64 {}

impl Scalar for f32 {
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            return unsafe { avx2::dot(a, b) };
        }
        portable_dot(a, b)
    }

    fn axpy(out: &mut [f32], c: f32, x: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { avx2::axpy(out, c, x) };
            return;
        }
        portable_axpy(out, c, x);
    }

    fn add_weighted_sum(out: &mut [f32], terms: &[(f32, &[f32])]) {
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { avx2::add_weighted_sum(out, terms) };
            return;
        }
        portable_add_weighted_sum(out, terms);
    }

    fn dots(a: &[f32], xs: &[&[f32]], out: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { avx2::dots(a, xs, out) };
            return;
        }
        for (out, x) in out.iter_mut().zip(xs) {
            *out = portable_dot(a, x);
        }
    }

    fn write_axpy(out: &mut [MaybeUninit<f32>], base: Option<&[f32]>, c: f32, x: &[f32]) {
        #[cfg(target_arch = "x86_64")]
        if avx2::available() {
            // SAFETY: the CPU has AVX2 and FMA.
            unsafe { avx2::write_axpy(out, base, c, x) };
            return;
        }
        portable_write_axpy(out, base, c, x);
    }
}

/// Rows of `width` elements per parallel task of an op that works row by row: about 16 K
/// elements (64 kB of f32), enough work to amortise the task while a band of rows and its
/// outputs stay in a core's cache.
pub(crate) fn rows_per_task(width: usize) -> usize {
    const ELEMENTS_PER_TASK: usize = 16 * 1024;
    (ELEMENTS_PER_TASK / width.max(1)).max(1)
}

/// A full-size output buffer left unwritten, for ops whose parallel tasks each zero their own
/// chunk with [`zeroed`] just before writing it: `vec![0; len]` is one memset of the whole
/// buffer on one thread before the tasks start (megabytes per op here, then read back from
/// memory), where a task's chunk is zeroed in its cache.
pub(crate) fn unwritten<E: Scalar>(len: usize) -> Vec<MaybeUninit<E>> {
    std::iter::repeat_with(MaybeUninit::uninit)
        .take(len)
        .collect()
}

/// `chunk` zeroed, as initialised elements.
pub(crate) fn zeroed<E: Scalar>(chunk: &mut [MaybeUninit<E>]) -> &mut [E] {
    for value in chunk.iter_mut() {
        value.write(E::zero());
    }
    // SAFETY: every element was written just above.
    unsafe { assume_written(chunk) }
}

/// The buffer of [`unwritten`] as its elements.
///
/// # Safety
/// Every element must have been written (each chunk of a partition of the buffer passed
/// through [`zeroed`] or [`write_axpy`]).
pub(crate) unsafe fn written<E: Scalar>(buffer: Vec<MaybeUninit<E>>) -> Vec<E> {
    let mut buffer = std::mem::ManuallyDrop::new(buffer);
    let (pointer, len, capacity) = (buffer.as_mut_ptr(), buffer.len(), buffer.capacity());
    // SAFETY: the allocation is `buffer`'s (not dropped), of the same layout, and every element
    // is initialised (the caller's contract).
    unsafe { Vec::from_raw_parts(pointer.cast::<E>(), len, capacity) }
}

/// An f32 or f64 value as f64.
pub(crate) fn to_f64<E: Scalar>(value: E) -> f64 {
    num_traits::ToPrimitive::to_f64(&value).expect("f32 or f64")
}

/// An f64 value as f32 or f64.
pub(crate) fn from_f64<E: Scalar>(value: f64) -> E {
    E::from(value).expect("f32 or f64")
}

/// A matrix in a slice: the element `(i, j)` at `i · row_stride + j · column_stride`.
#[derive(Clone, Copy)]
pub(crate) struct Strided<'a, E> {
    pub(crate) values: &'a [E],
    pub(crate) row_stride: usize,
    pub(crate) column_stride: usize,
}

impl<'a, E> Strided<'a, E> {
    /// Row-major with rows of `len`.
    pub(crate) fn row_major(values: &'a [E], len: usize) -> Self {
        Self {
            values,
            row_stride: len,
            column_stride: 1,
        }
    }

    /// The transpose of the row-major matrix with rows of `len`.
    pub(crate) fn transposed(values: &'a [E], len: usize) -> Self {
        Self {
            values,
            row_stride: 1,
            column_stride: len,
        }
    }

    /// Whether every element of an `m × n` matrix lies in the slice.
    fn covers(&self, m: usize, n: usize) -> bool {
        m == 0
            || n == 0
            || (m - 1) * self.row_stride + (n - 1) * self.column_stride < self.values.len()
    }
}

/// `a b` for `a` `[m, k]` and `b` `[k, n]`, a new row-major `[m, n]` (see [`product`]).
pub(crate) fn new_product<E: Scalar>(
    (m, n, k): (usize, usize, usize),
    a: Strided<'_, E>,
    b: Strided<'_, E>,
) -> Vec<E> {
    let mut out = vec![E::zero(); m * n];
    product(&mut out, false, (m, n, k), a, b);
    out
}

/// `out = a b` (or `out += a b` with `accumulate`) for `a` `[m, k]` and `b` `[k, n]` into the
/// row-major `out` `[m, n]`, through `gemm`, which Flex's own matrix products call: its
/// packed, register-blocked kernels read each operand once per panel, where a loop over the
/// rows would read the small one once per row.
pub(crate) fn product<E: Scalar>(
    out: &mut [E],
    accumulate: bool,
    (m, n, k): (usize, usize, usize),
    a: Strided<'_, E>,
    b: Strided<'_, E>,
) {
    assert!(
        out.len() == m * n && a.covers(m, k) && b.covers(k, n),
        "a product's operands do not cover [{m}, {k}] × [{k}, {n}]"
    );
    if m * n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            out.fill(E::zero());
        }
        return;
    }
    // Flex's threshold for a parallel product.
    let parallelism = if m * n * k >= 192 * 192 * 192 {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    let stride = |s: usize| s as isize;
    // SAFETY: `out` holds `[m, n]` row-major and `a`, `b` cover `[m, k]`, `[k, n]` with their
    // strides (asserted above); gemm takes f32 and f64 (the only `Scalar`s).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            stride(n),
            accumulate,
            a.values.as_ptr(),
            stride(a.column_stride),
            stride(a.row_stride),
            b.values.as_ptr(),
            stride(b.column_stride),
            stride(b.row_stride),
            E::one(),
            E::one(),
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// The shape of a Flex tensor of rank `D`.
pub(crate) fn dims<const D: usize>(tensor: &FlexTensor) -> [usize; D] {
    tensor.layout().shape().dims::<D>()
}

/// The elements of `tensor` in row-major order (borrowed when it is contiguous).
pub(crate) fn values<E: Scalar>(tensor: &FlexTensor) -> Cow<'_, [E]> {
    match tensor.as_slice::<E>() {
        Some(slice) => Cow::Borrowed(slice),
        None => Cow::Owned(
            tensor
                .to_contiguous()
                .as_slice::<E>()
                .expect("contiguous after the copy")
                .to_vec(),
        ),
    }
}

/// `(rows, width)` of a `[..., width]` tensor.
pub(crate) fn rows_and_width(tensor: &FlexTensor) -> (usize, usize) {
    let shape = tensor.layout().shape();
    let width = shape[shape.num_dims() - 1];
    (shape.num_elements() / width.max(1), width)
}

/// Row `t` of a `[T, width]` tensor's values.
pub(crate) fn token_row<E>(values: &[E], t: usize, width: usize) -> &[E] {
    &values[t * width..][..width]
}

/// Whether `tensor`'s elements lie in row-major order from its buffer's first byte.
pub(crate) fn row_major_from_start(tensor: &FlexTensor) -> bool {
    tensor.layout().is_contiguous() && tensor.layout().start_offset() == 0
}

/// `tensor` itself where its elements lie in row-major order from its buffer's first byte (see
/// [`row_major_from_start`]), else a copy that does.
pub(crate) fn contiguous(tensor: FlexTensor) -> FlexTensor {
    if row_major_from_start(&tensor) {
        tensor
    } else {
        tensor.to_contiguous()
    }
}

/// A contiguous Flex tensor.
pub(crate) fn tensor<E: Scalar, const D: usize>(values: Vec<E>, shape: [usize; D]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, shape))
}

/// `Σ_k a_k b_k` over the shorter of `a` and `b` ([`Scalar::dot`]).
pub(crate) fn dot<E: Scalar>(a: &[E], b: &[E]) -> E {
    E::dot(a, b)
}

/// `out += c x` over the shorter of `out` and `x` ([`Scalar::axpy`]).
pub(crate) fn axpy<E: Scalar>(out: &mut [E], c: E, x: &[E]) {
    E::axpy(out, c, x);
}

/// `out += Σ_i c_i x_i` ([`Scalar::add_weighted_sum`]): one pass over `out` for all the terms,
/// where an [`axpy`] per term reads and writes `out` once each. Every `x_i` covers `out`.
pub(crate) fn add_weighted_sum<E: Scalar>(out: &mut [E], terms: &[(E, &[E])]) {
    for (_, x) in terms {
        assert!(
            x.len() >= out.len(),
            "weighted sum: a term shorter than the output"
        );
    }
    E::add_weighted_sum(out, terms);
}

/// `out = Σ_i c_i x_i` into an [`unwritten`] chunk: the first term written, the rest added in
/// one pass, where zeroing the chunk first would be one more pass over it (zeros without
/// terms); the chunk as initialised elements. Every `x_i` covers `out`.
pub(crate) fn write_weighted_sum<'a, E: Scalar>(
    out: &'a mut [MaybeUninit<E>],
    terms: &[(E, &[E])],
) -> &'a mut [E] {
    match terms.split_first() {
        Some((&(c, x), rest)) => {
            let out = write_axpy(out, None, c, x);
            if !rest.is_empty() {
                add_weighted_sum(out, rest);
            }
            out
        }
        None => zeroed(out),
    }
}

/// `out_i = ⟨a, x_i⟩` over `a`'s length ([`Scalar::dots`]): `a` read once for all of them.
/// Every `x_i` covers `a`, and `out` has one entry per `x_i`.
pub(crate) fn dots<E: Scalar>(a: &[E], xs: &[&[E]], out: &mut [E]) {
    assert_eq!(xs.len(), out.len(), "dots: one output per vector");
    for x in xs {
        assert!(x.len() >= a.len(), "dots: a vector shorter than a");
    }
    E::dots(a, xs, out);
}

/// `out = base + c x` (`out = c x` without a base) into an [`unwritten`] chunk, in one pass where
/// zeroing, copying the base and adding would take three; the chunk as initialised elements.
pub(crate) fn write_axpy<'a, E: Scalar>(
    out: &'a mut [MaybeUninit<E>],
    base: Option<&[E]>,
    c: E,
    x: &[E],
) -> &'a mut [E] {
    assert!(
        x.len() >= out.len() && base.is_none_or(|base| base.len() >= out.len()),
        "write_axpy: the operands are shorter than the output"
    );
    E::write_axpy(out, base, c, x);
    // SAFETY: every element of `out` was written just above.
    unsafe { assume_written(out) }
}

/// An [`unwritten`] chunk as its elements.
///
/// # Safety
/// Every element of `chunk` must have been written.
pub(crate) unsafe fn assume_written<E: Scalar>(chunk: &mut [MaybeUninit<E>]) -> &mut [E] {
    // SAFETY: `MaybeUninit<E>` has `E`'s layout, and every element is initialised (the
    // caller's contract).
    unsafe { &mut *(std::ptr::from_mut(chunk) as *mut [E]) }
}

/// `Σ_k a_k b_k` with eight independent sums, so the compiler can vectorise it.
fn portable_dot<E: Scalar>(a: &[E], b: &[E]) -> E {
    let mut lanes = [E::zero(); 8];
    let (a_chunks, b_chunks) = (a.chunks_exact(8), b.chunks_exact(8));
    let (a_rest, b_rest) = (a_chunks.remainder(), b_chunks.remainder());
    for (x, y) in a_chunks.zip(b_chunks) {
        for lane in 0..8 {
            lanes[lane] += x[lane] * y[lane];
        }
    }
    let mut total = lanes.into_iter().fold(E::zero(), |sum, lane| sum + lane);
    for (&x, &y) in a_rest.iter().zip(b_rest) {
        total += x * y;
    }
    total
}

/// `out += c x`.
fn portable_axpy<E: Scalar>(out: &mut [E], c: E, x: &[E]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o += c * v;
    }
}

/// `out = base + c x` (`c x` without a base).
fn portable_write_axpy<E: Scalar>(out: &mut [MaybeUninit<E>], base: Option<&[E]>, c: E, x: &[E]) {
    match base {
        Some(base) => {
            for ((o, &b), &v) in out.iter_mut().zip(base).zip(x) {
                o.write(b + c * v);
            }
        }
        None => {
            for (o, &v) in out.iter_mut().zip(x) {
                o.write(c * v);
            }
        }
    }
}

/// `out += Σ_i c_i x_i`, eight outputs at a time kept in a local array across the terms.
fn portable_add_weighted_sum<E: Scalar>(out: &mut [E], terms: &[(E, &[E])]) {
    let start = out.len() / 8 * 8;
    let mut chunks = out.chunks_exact_mut(8);
    for (k, chunk) in chunks.by_ref().enumerate() {
        let mut lanes = [E::zero(); 8];
        lanes.copy_from_slice(chunk);
        for &(c, x) in terms {
            for (lane, &x) in lanes.iter_mut().zip(&x[k * 8..k * 8 + 8]) {
                *lane += c * x;
            }
        }
        chunk.copy_from_slice(&lanes);
    }
    let rest = chunks.into_remainder();
    for &(c, x) in terms {
        portable_axpy(rest, c, &x[start..]);
    }
}

/// The f32 loops with AVX2 and FMA intrinsics: eight lanes per register, the remainder in
/// scalar code. Callers check [`available`] first.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// Whether the CPU has AVX2 and FMA (detected once, then a cached load).
    pub(crate) fn available() -> bool {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }

    /// The sum of the eight lanes of `v`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn total(v: __m256) -> f32 {
        let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
        _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps::<1>(pairs, pairs)))
    }

    /// Eight lanes of `values` from `k` (`k + 8 <= values.len()`).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn load(values: &[f32], k: usize) -> __m256 {
        assert!(k + 8 <= values.len());
        // SAFETY: the eight lanes are inside `values` (checked above).
        unsafe { _mm256_loadu_ps(values.as_ptr().add(k)) }
    }

    /// Stores eight lanes into `values` from `k` (`k + 8 <= values.len()`).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn store(values: &mut [f32], k: usize, v: __m256) {
        assert!(k + 8 <= values.len());
        // SAFETY: the eight lanes are inside `values` (checked above).
        unsafe { _mm256_storeu_ps(values.as_mut_ptr().add(k), v) }
    }

    /// `Σ_k a_k b_k` (two sums of eight lanes, so that two FMAs are in flight).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
        let len = a.len().min(b.len());
        let split = len / 8 * 8;
        let (mut even, mut odd) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut k = 0;
        while k + 16 <= split {
            even = _mm256_fmadd_ps(load(a, k), load(b, k), even);
            odd = _mm256_fmadd_ps(load(a, k + 8), load(b, k + 8), odd);
            k += 16;
        }
        if k < split {
            even = _mm256_fmadd_ps(load(a, k), load(b, k), even);
        }
        let mut sum = total(_mm256_add_ps(even, odd));
        for k in split..len {
            sum += a[k] * b[k];
        }
        sum
    }

    /// `out += Σ_i c_i x_i`, 32 outputs at a time held in four registers across the terms.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn add_weighted_sum(out: &mut [f32], terms: &[(f32, &[f32])]) {
        let len = out.len();
        let mut k = 0;
        while k + 32 <= len {
            let mut sums: [__m256; 4] = std::array::from_fn(|j| load(out, k + 8 * j));
            for &(c, x) in terms {
                let c = _mm256_set1_ps(c);
                for (j, sum) in sums.iter_mut().enumerate() {
                    *sum = _mm256_fmadd_ps(c, load(x, k + 8 * j), *sum);
                }
            }
            for (j, sum) in sums.into_iter().enumerate() {
                store(out, k + 8 * j, sum);
            }
            k += 32;
        }
        while k + 8 <= len {
            let mut sum = load(out, k);
            for &(c, x) in terms {
                sum = _mm256_fmadd_ps(_mm256_set1_ps(c), load(x, k), sum);
            }
            store(out, k, sum);
            k += 8;
        }
        for (k, out) in out.iter_mut().enumerate().skip(k) {
            for &(c, x) in terms {
                *out += c * x[k];
            }
        }
    }

    /// `out_i = ⟨a, x_i⟩`, up to eight at a time, each chunk of `a` loaded once for all.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn dots(a: &[f32], xs: &[&[f32]], out: &mut [f32]) {
        for (xs, out) in xs.chunks(8).zip(out.chunks_mut(8)) {
            match xs.len() {
                1 => dots_of::<1>(a, xs, out),
                2 => dots_of::<2>(a, xs, out),
                3 => dots_of::<3>(a, xs, out),
                4 => dots_of::<4>(a, xs, out),
                5 => dots_of::<5>(a, xs, out),
                6 => dots_of::<6>(a, xs, out),
                7 => dots_of::<7>(a, xs, out),
                _ => dots_of::<8>(a, xs, out),
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    fn dots_of<const N: usize>(a: &[f32], xs: &[&[f32]], out: &mut [f32]) {
        let xs: &[&[f32]; N] = xs.try_into().expect("N vectors");
        let len = a.len();
        let split = len / 8 * 8;
        let mut sums = [_mm256_setzero_ps(); N];
        for k in (0..split).step_by(8) {
            let v = load(a, k);
            for (sum, x) in sums.iter_mut().zip(xs) {
                *sum = _mm256_fmadd_ps(v, load(x, k), *sum);
            }
        }
        for ((out, sum), x) in out.iter_mut().zip(sums).zip(xs) {
            *out = total(sum);
            for k in split..len {
                *out += a[k] * x[k];
            }
        }
    }

    /// `out = base + c x` (`c x` without a base), every element of `out` written (callers
    /// check that `base` and `x` are as long as `out`).
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn write_axpy(
        out: &mut [std::mem::MaybeUninit<f32>],
        base: Option<&[f32]>,
        c: f32,
        x: &[f32],
    ) {
        let len = out.len();
        assert!(x.len() >= len && base.is_none_or(|base| base.len() >= len));
        let split = len / 8 * 8;
        let scale = _mm256_set1_ps(c);
        let target = out.as_mut_ptr().cast::<f32>();
        for k in (0..split).step_by(8) {
            let sum = match base {
                Some(base) => _mm256_fmadd_ps(scale, load(x, k), load(base, k)),
                None => _mm256_mul_ps(scale, load(x, k)),
            };
            // SAFETY: the eight lanes are inside `out` (`k + 8 <= split <= len`).
            unsafe { _mm256_storeu_ps(target.add(k), sum) };
        }
        for k in split..len {
            let base = base.map_or(0.0, |base| base[k]);
            out[k].write(base + c * x[k]);
        }
    }

    /// `out += c x`.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) fn axpy(out: &mut [f32], c: f32, x: &[f32]) {
        let len = out.len().min(x.len());
        let split = len / 8 * 8;
        let scale = _mm256_set1_ps(c);
        for k in (0..split).step_by(8) {
            let sum = _mm256_fmadd_ps(scale, load(x, k), load(out, k));
            store(out, k, sum);
        }
        for k in split..len {
            out[k] += c * x[k];
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Values in (-1, 1] from a fixed sequence.
    pub(crate) fn sequence(len: usize, seed: u64) -> Vec<f32> {
        let mut uniform = crate::test_util::fixed_uniform(seed);
        (0..len).map(|_| (2.0 * uniform() - 1.0) as f32).collect()
    }

    /// The f32 loops the CPU runs (AVX2 where it has it) against the portable ones, for
    /// lengths around the lanes' multiples.
    #[test]
    fn f32_loops_match_the_portable_ones() {
        for len in [0, 1, 7, 8, 15, 16, 17, 24, 255, 256, 1000] {
            let (a, b) = (sequence(len, 1), sequence(len, 2));
            let (fast, portable) = (dot(&a, &b), portable_dot(&a, &b));
            assert!(
                (fast - portable).abs() <= 1e-4 * (1.0 + portable.abs()),
                "dot, {len}"
            );
            let (mut fast, mut portable) = (a.clone(), a.clone());
            axpy(&mut fast, 0.37, &b);
            portable_axpy(&mut portable, 0.37, &b);
            for (fast, portable) in fast.iter().zip(&portable) {
                assert!((fast - portable).abs() <= 1e-6, "axpy, {len}");
            }
            // Written whole, with and without a base, against the accumulating axpy.
            for base in [Some(b.as_slice()), None] {
                let mut fast = unwritten::<f32>(len);
                let written = write_axpy(&mut fast, base, 0.37, &a).to_vec();
                let mut portable = unwritten::<f32>(len);
                portable_write_axpy(&mut portable, base, 0.37, &a);
                let portable = unsafe { assume_written(&mut portable) };
                let mut reference = base.map_or(vec![0.0; len], <[f32]>::to_vec);
                portable_axpy(&mut reference, 0.37, &a);
                for ((fast, portable), reference) in written.iter().zip(&*portable).zip(&reference)
                {
                    assert!((fast - reference).abs() <= 1e-6, "write_axpy, {len}");
                    assert!((portable - reference).abs() <= 1e-6, "write_axpy, {len}");
                }
            }
            // Up to nine vectors: the AVX2 dots go eight at a time.
            let vectors: Vec<Vec<f32>> = (0..9).map(|i| sequence(len, 3 + i)).collect();
            for count in [1, 3, 4, 8, 9] {
                let xs: Vec<&[f32]> = vectors[..count].iter().map(Vec::as_slice).collect();
                let mut fast = vec![0.0; count];
                dots(&a, &xs, &mut fast);
                for (fast, x) in fast.iter().zip(&xs) {
                    let portable = portable_dot(&a, x);
                    assert!(
                        (fast - portable).abs() <= 1e-4 * (1.0 + portable.abs()),
                        "dots, {len}"
                    );
                }
                let terms: Vec<(f32, &[f32])> = xs
                    .iter()
                    .enumerate()
                    .map(|(i, &x)| (0.3 - 0.2 * i as f32, x))
                    .collect();
                let (mut fast, mut portable) = (a.clone(), a.clone());
                add_weighted_sum(&mut fast, &terms);
                portable_add_weighted_sum(&mut portable, &terms);
                let mut one_by_one = a.clone();
                for &(c, x) in &terms {
                    portable_axpy(&mut one_by_one, c, x);
                }
                for ((fast, portable), reference) in fast.iter().zip(&portable).zip(&one_by_one) {
                    assert!((fast - reference).abs() <= 1e-5, "weighted sum, {len}");
                    assert!((portable - reference).abs() <= 1e-5, "weighted sum, {len}");
                }
            }
        }
    }
}
