#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod activation;
pub mod ancre;
pub mod attention_residuals;
mod backend;
/// The CUDA C++ of the crate's heaviest kernels, made without a GPU (the `kernel-source`
/// feature; `tools/gpu/sass.sh` reads its machine code).
#[cfg(feature = "kernel-source")]
#[doc(hidden)]
pub use backend::kernel_source;
mod block;
pub mod compression;
mod connectivity;
pub mod denseformer;
mod depth_ln;
pub mod device;
mod error;
pub mod guide;
pub mod hacn;
pub mod health;
pub mod hyper_connections;
pub mod hyperzzw;
pub mod laurel;
#[doc = include_str!("../docs/MATH.md")]
///
/// Source comments and module docs cite its sections as `MATH §N`.
pub mod math {}
mod matrix;
pub mod mhc;
pub mod mhc_lite;
pub mod mhc_v4;
mod mlp;
pub mod mudd;
mod multi_stream;
#[cfg(feature = "plot")]
pub mod plot;
mod stack;
#[cfg(test)]
mod test_util;
pub mod training;
pub mod transformer;

pub use activation::gelu;
pub use ancre::{Ancre, AncreConfig, AncreInit, AncreState, Mixing, ModuleLevel, Normalization};
pub use attention_residuals::{
    AttentionResiduals, AttentionResidualsConfig, AttentionResidualsState, AttnResOutput,
};
pub use block::Block;
pub use connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity, probe_matrix};
pub use denseformer::{DenseFormer, DenseFormerConfig, DenseFormerState};
pub use depth_ln::{DepthLn, DepthLnConfig};
pub use error::{Error, Result};
pub use hacn::{GateInit, Hacn, HacnConfig, HacnState};
pub use hyper_connections::{HyperConnections, HyperConnectionsConfig};
pub use laurel::{Laurel, LaurelConfig, LaurelForm, LaurelState};
pub use matrix::ConnectivityMatrix;
pub use mhc::{Mhc, MhcConfig, sinkhorn_knopp};
pub use mhc_lite::{MhcLite, MhcLiteConfig};
pub use mhc_v4::{MhcV4, MhcV4Config};
pub use mlp::{BlockNorm, MlpBlock, MlpBlockConfig};
pub use mudd::{Mudd, MuddConfig, MuddState, MuddWays};
pub use multi_stream::{MultiStreamState, StreamReduce};
pub use stack::Stack;
