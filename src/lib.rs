#![doc = include_str!("../README.md")]
#![warn(missing_docs)]

mod activation;
pub mod ancre;
pub mod backend;
mod block;
pub mod compression;
mod connectivity;
mod depth_ln;
mod error;
pub mod guide;
pub mod hacn;
pub mod health;
pub mod hyperzzw;
mod matrix;
mod mlp;
#[cfg(feature = "plot")]
pub mod plot;
mod stack;
#[cfg(test)]
mod test_util;
pub mod training;
pub mod transformer;

pub use activation::gelu;
pub use ancre::{Ancre, AncreConfig, AncreInit, AncreState, Normalization};
pub use block::Block;
pub use connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity, probe_matrix};
pub use depth_ln::{DepthLn, DepthLnConfig};
pub use error::{Error, Result};
pub use hacn::{GateInit, Hacn, HacnConfig, HacnState};
pub use matrix::ConnectivityMatrix;
pub use mlp::{BlockNorm, MlpBlock, MlpBlockConfig};
pub use stack::Stack;
