//! Gradients handed from one fused op's backward to a later one's, so that a layer's gradients
//! are summed inside the kernels that compute them rather than by autodiff's additions (a
//! full-size elementwise kernel each on CubeCL, where the backward does not fuse).
//!
//! A layer whose connections are one table (see [`connection_tables`](super::connection_tables))
//! reads its units `S` and its table `M` in three ops, created in this order: the table (from
//! `S`), the block input (`M`'s view rows with `S`), the next units (`M`'s residual rows and `β`
//! with `S` and the block output). Autodiff runs their backward in the reverse order, and runs
//! the earlier ones whenever a later one has a tracked input they share. So the ops agree on a
//! key (one per layer and pass, from [`new_key`]): the next units' backward leaves `∂M` and its
//! part of `∂S` here, the block input's backward adds its parts to them in its kernel and leaves
//! `∂S` again (it registers `∂M` whole), and the table's backward adds its part of `∂S` in its
//! kernel and registers it. Each is left only where the op that takes it is sure to run (its
//! input is tracked); key 0 is "no slot": every op registers its own gradients.
//!
//! The slots are keyed globally (the ops reach them from Burn's backend traits, whose arguments
//! are tensors and plain numbers); a taken slot is removed.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{LazyLock, Mutex};

/// What a slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Part {
    /// The table's gradient.
    Table,
    /// The units' gradient.
    Units,
    /// The block input's gradient and its number of views.
    BlockInput,
}

type Slots = HashMap<(u64, Part), Box<dyn Any + Send>>;

static SLOTS: LazyLock<Mutex<Slots>> = LazyLock::new(|| Mutex::new(HashMap::new()));

static NEXT_KEY: AtomicU64 = AtomicU64::new(1);

/// A fresh key (never 0).
pub(crate) fn new_key() -> u64 {
    NEXT_KEY.fetch_add(1, Ordering::Relaxed)
}

fn slots() -> std::sync::MutexGuard<'static, Slots> {
    SLOTS
        .lock()
        .expect("no op panics while holding the gradient slots")
}

/// Leaves `value` in slot `(key, part)`, or hands it back where the slot is already filled (a
/// layer's state stepped twice): the caller then registers it with autodiff as usual.
pub(crate) fn leave<T: Any + Send>(key: u64, part: Part, value: T) -> Result<(), T> {
    debug_assert_ne!(key, 0, "key 0 has no slot");
    let mut slots = slots();
    if slots.contains_key(&(key, part)) {
        return Err(value);
    }
    slots.insert((key, part), Box::new(value));
    Ok(())
}

/// Takes what slot `(key, part)` holds, if anything (key 0: nothing).
pub(crate) fn take<T: Any + Send>(key: u64, part: Part) -> Option<T> {
    if key == 0 {
        return None;
    }
    let value = slots().remove(&(key, part))?;
    Some(
        *value
            .downcast::<T>()
            .expect("a slot is taken as the type it was left as"),
    )
}
