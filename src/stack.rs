//! The generic wrapper: any stack of blocks driven by any connectivity.

use burn::module::ModuleDisplay;
use burn::prelude::*;

use crate::block::Block;
use crate::connectivity::{Connectivity, ConnectivityConfig, StreamConnectivity};
use crate::error::{Error, Result, check_depth};
use crate::matrix::ConnectivityMatrix;

/// A stack of blocks `f_1..f_L` wired by a connectivity `C`.
///
/// With `s_0 = x`, block `j` reads `s_{j-1}` and produces `h_j = f_j(s_{j-1})`; the
/// connectivity turns the branch outputs into the next input and into the output `y`
/// (see [`StreamConnectivity`]). The record paths of the blocks are `blocks.{j}.…`, those of the
/// connectivity `connectivity.…`.
///
/// ```
/// use burn::{prelude::*, tensor::Distribution};
/// use burn_connectivity::{HacnConfig, MlpBlockConfig, Stack};
///
/// let device = Device::flex();
/// let blocks = MlpBlockConfig::new(16, 32).init_stack(4, &device)?;
/// let stack = Stack::new(blocks, &HacnConfig::new(), &device)?;
///
/// let x = Tensor::<3>::random([2, 5, 16], Distribution::Default, &device);
/// let y = stack.forward(x.clone());                  // y = Σ_i h_i
/// let readout = stack.readout(x);                    // y_0 .. y_4
/// assert_eq!(readout.len(), 5);
/// let compressed = stack.truncated(2)?;              // a real 2-block model computing y_2
/// let c = stack.matrix();                            // C and the output column
/// assert_eq!(c.num_blocks(), 4);
/// # Ok::<(), burn_connectivity::Error>(())
/// ```
#[derive(Module, Debug)]
pub struct Stack<M, C> {
    /// The branches, in order.
    pub blocks: Vec<M>,
    /// How the branches are wired.
    pub connectivity: C,
}

impl<M: Module + ModuleDisplay, C: Connectivity> Stack<M, C> {
    /// Wraps `blocks` with the connectivity `config` builds for them on `device`.
    ///
    /// # Errors
    /// [`Error::NoBlocks`] for an empty stack, or whatever `config` rejects.
    pub fn new(
        blocks: Vec<M>,
        config: &impl ConnectivityConfig<Connectivity = C>,
        device: &Device,
    ) -> Result<Self> {
        if blocks.is_empty() {
            return Err(Error::NoBlocks);
        }
        let connectivity = config.init(blocks.len(), device)?;
        Self::from_parts(blocks, connectivity)
    }

    /// Wraps `blocks` with an existing connectivity.
    ///
    /// # Errors
    /// [`Error::NoBlocks`] for an empty stack, [`Error::BlockCountMismatch`] if the
    /// connectivity was built for another number of blocks.
    pub fn from_parts(blocks: Vec<M>, connectivity: C) -> Result<Self> {
        if blocks.is_empty() {
            return Err(Error::NoBlocks);
        }
        if connectivity.num_blocks() != blocks.len() {
            return Err(Error::BlockCountMismatch {
                connectivity: connectivity.num_blocks(),
                blocks: blocks.len(),
            });
        }
        Ok(Self {
            blocks,
            connectivity,
        })
    }

    /// Number of blocks `L`.
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The direct connectivity matrix `C` and output column of the connectivity.
    pub fn matrix(&self) -> ConnectivityMatrix {
        self.connectivity.matrix()
    }

    /// A smaller model made of the first `depth` blocks, whose output is this model's readout
    /// `y_depth`: what to deploy after auto-compression.
    ///
    /// # Errors
    /// [`Error::DepthOutOfRange`] unless `1 <= depth <= L`.
    pub fn truncated(&self, depth: usize) -> Result<Self> {
        check_depth(depth, 1, self.num_blocks())?;
        Self::from_parts(
            self.blocks[..depth].to_vec(),
            self.connectivity.truncated(depth)?,
        )
    }

    /// Checks the input's shape against what the connectivity requires and its feature width
    /// (last axis) against the widths the blocks declare.
    ///
    /// # Errors
    /// The connectivity's error, or [`Error::WidthMismatch`] naming the first block that does
    /// not accept the input.
    pub fn check_input<const D: usize>(&self, input: &Tensor<D>) -> Result<()>
    where
        M: Block<D>,
    {
        self.connectivity.check_input(&input.dims())?;
        let found = input.dims()[D - 1];
        for (index, block) in self.blocks.iter().enumerate() {
            match block.width() {
                Some(expected) if expected != found => {
                    return Err(Error::WidthMismatch {
                        name: format!("input of block {index}"),
                        expected,
                        found,
                    });
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// The connectivity state after running the first `depth` blocks on `input`.
    ///
    /// `connectivity.output(&state)` is the readout `y_depth` and
    /// `connectivity.block_input(&state)` the stream `s_depth`.
    ///
    /// # Errors
    /// [`Error::DepthOutOfRange`] unless `depth <= L`.
    pub fn run<const D: usize>(
        &self,
        input: Tensor<D>,
        depth: usize,
        context: &M::Context,
    ) -> Result<C::State>
    where
        M: Block<D>,
        C: StreamConnectivity<D>,
    {
        check_depth(depth, 0, self.num_blocks())?;
        Ok(self.run_blocks(input, depth, context, |_| {}))
    }

    /// The model output `y`.
    ///
    /// # Panics
    /// If the input's width does not fit the connectivity or the blocks: the message names both
    /// widths; [`Stack::check_input`] returns the same as an [`Error`].
    pub fn forward<const D: usize>(&self, input: Tensor<D>) -> Tensor<D>
    where
        M: Block<D, Context: Default>,
        C: StreamConnectivity<D>,
    {
        self.forward_with(input, &Default::default())
    }

    /// The model output `y`, passing `context` to every block.
    ///
    /// # Panics
    /// If the input's width does not fit the connectivity or the blocks: the message names both
    /// widths; [`Stack::check_input`] returns the same as an [`Error`].
    pub fn forward_with<const D: usize>(&self, input: Tensor<D>, context: &M::Context) -> Tensor<D>
    where
        M: Block<D>,
        C: StreamConnectivity<D>,
    {
        let state = self.run_blocks(input, self.num_blocks(), context, |_| {});
        self.connectivity.output(&state)
    }

    /// The readout `y_depth`, running only the first `depth` blocks (`y_0` is the readout of
    /// the input alone).
    ///
    /// # Errors
    /// [`Error::DepthOutOfRange`] unless `depth <= L`.
    pub fn forward_depth<const D: usize>(&self, input: Tensor<D>, depth: usize) -> Result<Tensor<D>>
    where
        M: Block<D, Context: Default>,
        C: StreamConnectivity<D>,
    {
        self.forward_depth_with(input, depth, &Default::default())
    }

    /// [`Stack::forward_depth`] with a block context.
    ///
    /// # Errors
    /// [`Error::DepthOutOfRange`] unless `depth <= L`.
    pub fn forward_depth_with<const D: usize>(
        &self,
        input: Tensor<D>,
        depth: usize,
        context: &M::Context,
    ) -> Result<Tensor<D>>
    where
        M: Block<D>,
        C: StreamConnectivity<D>,
    {
        let state = self.run(input, depth, context)?;
        Ok(self.connectivity.output(&state))
    }

    /// The layer-wise readout `[y_0, y_1, …, y_L]`: the output "up to block k" for every `k`,
    /// in one pass. `y_L` is the model output.
    ///
    /// # Panics
    /// If the input's width does not fit the connectivity or the blocks: the message names both
    /// widths; [`Stack::check_input`] returns the same as an [`Error`].
    pub fn readout<const D: usize>(&self, input: Tensor<D>) -> Vec<Tensor<D>>
    where
        M: Block<D, Context: Default>,
        C: StreamConnectivity<D>,
    {
        self.readout_with(input, &Default::default())
    }

    /// [`Stack::readout`] with a block context.
    ///
    /// # Panics
    /// If the input's width does not fit the connectivity or the blocks: the message names both
    /// widths; [`Stack::check_input`] returns the same as an [`Error`].
    pub fn readout_with<const D: usize>(
        &self,
        input: Tensor<D>,
        context: &M::Context,
    ) -> Vec<Tensor<D>>
    where
        M: Block<D>,
        C: StreamConnectivity<D>,
    {
        let mut readouts = Vec::with_capacity(self.num_blocks() + 1);
        let state = self.run_blocks(input, self.num_blocks(), context, |state| {
            readouts.push(self.connectivity.output(state));
        });
        readouts.push(self.connectivity.output(&state));
        readouts
    }

    /// Runs the first `depth` blocks, calling `before_block` with the state before each.
    fn run_blocks<const D: usize>(
        &self,
        input: Tensor<D>,
        depth: usize,
        context: &M::Context,
        mut before_block: impl FnMut(&C::State),
    ) -> C::State
    where
        M: Block<D>,
        C: StreamConnectivity<D>,
    {
        // Host-side shape checks, so that a mismatch names both settings instead of failing
        // inside a reshape of the first block.
        if let Err(err) = self.check_input(&input) {
            panic!("{err} (`Stack::check_input` returns this as an error)");
        }
        let connectivity = &self.connectivity;
        let mut state = connectivity.start(input);
        for (index, block) in self.blocks[..depth].iter().enumerate() {
            before_block(&state);
            let branch = block.branch(connectivity.block_input(&state), context);
            state = connectivity.step(state, index, branch);
        }
        state
    }
}
