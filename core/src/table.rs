//! Storage for bookkeeping that grows with the objects a user creates: the doorbell-record pages, the firmware
//! page chunks and the CQ table of an [`Hca`](crate::hca::Hca).
//!
//! The core has no heap, so it does not choose: a [`Table`] is a vector-like container its user supplies. Here it
//! is implemented for `heapless::Vec` (a fixed capacity, for firmware and small systems); a host with a heap
//! implements it over its own growable vector, so what the device advertises can be created
//! ([`Tables`](crate::hca::Tables) picks one table per pool).

/// A vector of `T` the pools keep their entries in: in order, inserted and removed anywhere.
///
/// Growth happens only through [`Table::reserve_one`] and [`Table::insert`], which the pools call when an object
/// is created, never on the datapath.
pub trait Table<T>: Default {
    /// The most entries it can ever hold (`usize::MAX` when only memory limits it).
    const CAPACITY: usize;

    /// The entries, in order.
    fn as_slice(&self) -> &[T];

    /// The entries, in order, for change in place.
    fn as_mut_slice(&mut self) -> &mut [T];

    /// Makes sure one more [`Table::insert`] succeeds; false when it cannot (full, or no memory).
    fn reserve_one(&mut self) -> bool;

    /// Inserts `value` at `index` (`<= len`), moving later entries up; gives it back when there is no room.
    fn insert(&mut self, index: usize, value: T) -> Result<(), T>;

    /// Removes and returns the entry at `index` (`< len`), moving later entries down.
    fn remove(&mut self, index: usize) -> Option<T>;

    /// Entries held.
    fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether it holds none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends `value`; gives it back when there is no room.
    fn push(&mut self, value: T) -> Result<(), T> {
        self.insert(self.len(), value)
    }
}

impl<T, const N: usize> Table<T> for heapless::Vec<T, N> {
    const CAPACITY: usize = N;

    fn as_slice(&self) -> &[T] {
        self
    }

    fn as_mut_slice(&mut self) -> &mut [T] {
        self
    }

    fn reserve_one(&mut self) -> bool {
        !self.is_full()
    }

    fn insert(&mut self, index: usize, value: T) -> Result<(), T> {
        if index > heapless::Vec::len(self) {
            return Err(value);
        }
        heapless::Vec::insert(self, index, value)
    }

    fn remove(&mut self, index: usize) -> Option<T> {
        (index < heapless::Vec::len(self)).then(|| heapless::Vec::remove(self, index))
    }
}

/// The growable table a host with a heap uses (`mlx5-verbs`' `VecTable`, the same source), for the core's own
/// tests of pools past any fixed capacity.
#[cfg(test)]
pub(crate) mod growable {
    extern crate std;
    use super::Table;
    use std::vec::Vec;

    include!("table/vec.rs");

    pub(crate) type Grow<T> = VecTable<T>;
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_table_holds_its_capacity_and_refuses_more() {
        let mut t = heapless::Vec::<u8, 3>::new();
        assert_eq!(<heapless::Vec<u8, 3> as Table<u8>>::CAPACITY, 3);
        assert!(Table::push(&mut t, 1).is_ok() && Table::push(&mut t, 3).is_ok());
        assert!(Table::insert(&mut t, 1, 2).is_ok());
        assert_eq!(Table::as_slice(&t), [1, 2, 3]);
        assert!(!t.reserve_one());
        assert_eq!(Table::push(&mut t, 4), Err(4));
        assert_eq!(Table::remove(&mut t, 0), Some(1));
        assert_eq!(Table::remove(&mut t, 5), None, "out of range: nothing, no panic");
        assert_eq!(Table::insert(&mut t, 9, 7), Err(7));
        assert!(t.reserve_one());
    }
}
