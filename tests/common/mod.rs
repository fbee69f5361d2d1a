//! Helpers shared by the integration test binaries.

use std::sync::{Mutex, MutexGuard, PoisonError};

use burn::prelude::*;

/// Holds the tests of a binary to one at a time (Flex's generator is one per process) and seeds
/// the generator through `device`: the draws made while the guard lives are the same in every
/// run.
pub fn seeded(device: &Device, seed: u64) -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    let guard = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    device.seed(seed);
    guard
}
