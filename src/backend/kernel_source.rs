//! The CUDA C++ that CubeCL writes for the crate's heaviest kernels, made offline: no GPU and
//! no CUDA driver, only CubeCL's C++ compiler (`cubecl-cpp`) and the properties of an NVIDIA
//! H100 (SM 9.0) written out below.
//!
//! What it is for: most sessions of this project have no GPU, and a kernel's cost on one was
//! measured only when one was lent. The machine code a kernel compiles to can be read without a
//! GPU: `tools/gpu/sass.sh` compiles these sources with NVRTC and `ptxas` (NVIDIA's pip wheels)
//! for `sm_90a`, as CubeCL's CUDA runtime does on a GPU machine (`--gpu-architecture=sm_90a`),
//! and reports each kernel's registers, spills and what its loops issue per multiply-add. That
//! is a static check of the instruction stream, never a timing.
//!
//! The kernels are built exactly as their launches build them (the same `#[cube(launch)]`
//! expansion, the same comptime arguments from the same helpers), for the model workload's
//! shapes; a kernel's source does not depend on its tensors' sizes, only on those arguments.

use std::sync::Arc;

use cubecl::ir::features::TypeUsage;
use cubecl::ir::settings::KernelSettings;
use cubecl::ir::types::MatrixLayout;
use cubecl::ir::{
    AddressType, ContiguousElements, DeviceIdentity, DeviceProperties, ElemType, FloatKind,
    HardwareProperties, MemoryDeviceProperties, MmaProperties, TargetProperties, VectorSize,
};
use cubecl::prelude::{
    BufferCompilationArg, CubeDim, ExecutionMode, TensorCompilationArg, TensorMetaCompilationArg,
};
use cubecl::{Compiler, CubeKernel};
use cubecl_cpp::shared::{CompilationOptions, CppCompiler, CppSupportedFeatures};

/// One kernel's CUDA C++, with the launch it was built for.
#[derive(Debug, Clone)]
pub struct CudaKernel {
    /// What the kernel is, in this crate's words (e.g. `normalised_forward`).
    pub name: String,
    /// The shape it was built for, in words.
    pub case: String,
    /// The CUDA entry point (CubeCL's name for it).
    pub entry: String,
    /// The CUDA C++ source.
    pub source: String,
    /// Bytes of shared memory a cube takes (CubeCL's dynamic shared memory).
    pub shared_bytes: usize,
    /// Units per cube.
    pub threads: u32,
    /// Cubes at the workload's shape.
    pub cubes: usize,
}

/// The device the kernels are built for: an NVIDIA H100 (SM 9.0) as CubeCL's CUDA runtime
/// describes one (its hardware properties, f16/bf16/f32/f64 support, grid constants).
pub(crate) struct Target {
    device: Arc<DeviceProperties>,
    runtime: Arc<TargetProperties>,
    options: CompilationOptions,
}

impl Target {
    pub(crate) fn h100() -> Self {
        let hardware = HardwareProperties {
            load_width: 128,
            vector_register_count: None,
            plane_size_min: 32,
            plane_size_max: 32,
            max_bindings: 1024,
            max_shared_memory_size: 232_448,
            max_cube_count: (i32::MAX as u32, 65_535, 65_535),
            max_units_per_cube: 1024,
            max_cube_dim: (1024, 1024, 64),
            num_streaming_multiprocessors: Some(132),
            num_tensor_cores: None,
            min_tensor_cores_dim: None,
            num_cpu_cores: None,
            last_level_cache_size: None,
            max_vector_size: VectorSize::MAX,
            cube_mma_reserved_shared_memory: 0,
        };
        let mut device = DeviceProperties::new(
            Default::default(),
            MemoryDeviceProperties::new(1 << 34, 256),
            hardware,
            cubecl::profile::TimingMethod::Device,
            DeviceIdentity {
                name: "NVIDIA H100 (static)".into(),
                fingerprint: "ptx_sm90".into(),
                physical: None,
            },
        );
        cubecl_cpp::register_supported_types(&mut device);
        device.register_type_usage(ElemType::Float(FloatKind::TF32), TypeUsage::Conversion);
        let runtime = TargetProperties {
            mma: MmaProperties {
                register_size_bits: 32,
                const_plane_size: 32,
                register_layout_a: MatrixLayout::RowMajor,
                register_layout_b: MatrixLayout::ColMajor,
                register_layout_acc: MatrixLayout::RowMajor,
                register_duplication_a: 1,
                register_duplication_b: 1,
                register_duplication_acc: 1,
                // No kernel here uses the matrix units.
                contiguous_elements: ContiguousElements::new(|_, _, _| 1),
            },
        };
        // As CubeCL's CUDA runtime sets them for SM 9.0.
        let options = CompilationOptions {
            warp_size: 32,
            supports_features: CppSupportedFeatures {
                grid_constants: true,
                clusters: true,
                fast_math: true,
                fast_tanh: true,
                elect_sync: true,
                dp4a: true,
            },
            ..Default::default()
        };
        Self {
            device: Arc::new(device),
            runtime: Arc::new(runtime),
            options,
        }
    }

    pub(crate) fn hardware(&self) -> &HardwareProperties {
        &self.device.hardware
    }

    /// The settings of a launch of `threads` units per cube (checked, as `launch` is).
    pub(crate) fn settings(&self, threads: usize) -> KernelSettings {
        KernelSettings::new(
            CubeDim::new_1d(threads as u32).into(),
            ExecutionMode::Checked,
            AddressType::U32,
        )
    }

    pub(crate) fn device(&self) -> Arc<DeviceProperties> {
        self.device.clone()
    }

    pub(crate) fn runtime(&self) -> Arc<TargetProperties> {
        self.runtime.clone()
    }

    /// The kernel's CUDA C++.
    pub(crate) fn compile(
        &self,
        name: &str,
        case: &str,
        kernel: impl CubeKernel,
        threads: usize,
        cubes: usize,
    ) -> Result<CudaKernel, String> {
        let definition = cubecl::define_kernel(&kernel).map_err(|e| format!("{name}: {e:?}"))?;
        let entry = definition.settings.kernel_name.clone();
        let compiled = CppCompiler::<cubecl_cpp::target::Cuda>::default()
            .compile(definition, &self.options)
            .map_err(|e| format!("{name}: {e:?}"))?;
        Ok(CudaKernel {
            name: name.into(),
            case: case.into(),
            entry,
            shared_bytes: compiled.shared_memory_size,
            source: compiled.source,
            threads: threads as u32,
            cubes,
        })
    }
}

/// The compilation argument of a plain tensor (its own buffer, not an alias of another).
pub(crate) fn tensor() -> TensorCompilationArg {
    TensorCompilationArg {
        meta: TensorMetaCompilationArg { len: (), rank: () },
        buffer: BufferCompilationArg { inplace: None },
    }
}

/// f32 tensors summed in f32, as [`float_types`](super::cube_launch::float_types) gives.
pub(crate) const F32: [ElemType; 2] = [ElemType::Float(FloatKind::F32); 2];

/// The model workload (`[8, 1024]` tokens, `d = 768`, `n = 4` streams, f32): the kernels of
/// mHC's and HC's connection tables and of the weights' gradient, as their launches build them
/// with the default knobs.
pub fn model_workload_kernels() -> Result<Vec<CudaKernel>, String> {
    let target = Target::h100();
    let tokens = 8 * 1024;
    let (streams, width) = (4, 768);
    let mut kernels = super::connection_tables::cuda_kernels(&target, tokens, streams, width)?;
    kernels.extend(super::cube_launch::cuda_kernels(
        &target, tokens, streams, width,
    )?);
    Ok(kernels)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel compiles to CUDA C++ whose entry point is the one listed, launched with
    /// the listed units; the weights' product keeps exactly its step's rows of `s ⊙ δ` in
    /// shared memory (8 rows of mHC's 24 columns, HC's 6, f32).
    #[test]
    fn the_model_workload_kernels_compile_to_cuda() {
        // Under the default knobs, whatever other tests set meanwhile.
        let [kernels] = crate::backend::with_each_knobs([Default::default()], || {
            model_workload_kernels().unwrap()
        });
        let names: Vec<_> = kernels.iter().map(|k| k.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "normalised_forward",
                "normalised_backward",
                "gated_forward",
                "gated_backward",
                "weights_product (mHC)",
                "weights_product (HC)"
            ]
        );
        for kernel in &kernels {
            let entry = format!(
                "__global__ void __launch_bounds__({})  {}(",
                kernel.threads, kernel.entry
            );
            assert!(
                kernel.source.contains(&entry),
                "{}: no {entry}",
                kernel.name
            );
            assert!(kernel.cubes > 0);
        }
        let shared: Vec<_> = kernels[4..].iter().map(|k| k.shared_bytes).collect();
        assert_eq!(shared, [8 * 24 * 4, 8 * 6 * 4]);
    }
}
