// A growable `Table` over a heap `Vec`, in one copy for a host with a heap (`mlx5-verbs`' `VecTable`, which
// `include!`s it) and the core's own tests (`table::growable`). The core has no heap, so it is no module of its
// own: each includer has `Vec` and `Table` in scope.

/// A growable [`Table`]: a vector that grows when an object is created (never on the datapath) and gives memory
/// back as entries go. Running out of memory is a refused insert (`try_reserve`), so a create fails with a typed
/// error instead of aborting the process.
#[derive(Debug)]
pub struct VecTable<T>(Vec<T>);

impl<T> Default for VecTable<T> {
    fn default() -> Self {
        Self(Vec::new())
    }
}

impl<T> Table<T> for VecTable<T> {
    const CAPACITY: usize = usize::MAX;

    fn as_slice(&self) -> &[T] {
        &self.0
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        &mut self.0
    }

    fn reserve_one(&mut self) -> bool {
        self.0.try_reserve(1).is_ok()
    }

    fn insert(&mut self, index: usize, value: T) -> Result<(), T> {
        if index > self.0.len() || !self.reserve_one() {
            return Err(value);
        }
        self.0.insert(index, value);
        Ok(())
    }

    fn remove(&mut self, index: usize) -> Option<T> {
        let v = (index < self.0.len()).then(|| self.0.remove(index));
        // Shrink once three quarters are unused, so a burst of objects does not pin its bookkeeping.
        if self.0.capacity() > 64 && self.0.len() < self.0.capacity() / 4 {
            self.0.shrink_to(self.0.capacity() / 2);
        }
        v
    }
}
