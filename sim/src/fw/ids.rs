//! Object numbers: [`alloc_id`] over any table by number ([`Ids`]), and [`IdSet`] for the ALLOC/DEALLOC
//! objects that hold nothing but their number.

use std::collections::{BTreeMap, BTreeSet};

use crate::small::IdMap;

/// A table of objects by number, as [`alloc_id`] sees it.
pub(crate) trait Ids {
    fn count(&self) -> usize;
    fn holds(&self, id: u32) -> bool;
}

impl<V> Ids for BTreeMap<u32, V> {
    fn count(&self) -> usize {
        self.len()
    }
    fn holds(&self, id: u32) -> bool {
        self.contains_key(&id)
    }
}

impl<V> Ids for IdMap<V> {
    fn count(&self) -> usize {
        self.len()
    }
    fn holds(&self, id: u32) -> bool {
        self.contains_key(&id)
    }
}

/// Picks a free id in `lo..hi`, starting at `*next` and wrapping, so freed ids are not reused at once.
/// Bounded: with `used.count()` ids taken, one of the next `used.count() + 1` candidates is free.
pub(crate) fn alloc_id(used: &impl Ids, next: &mut u32, lo: u32, hi: u32) -> Option<u32> {
    let span = hi.checked_sub(lo)?;
    if used.count() as u64 >= u64::from(span) {
        return None;
    }
    let mut id = (*next).clamp(lo, hi - 1);
    for _ in 0..=used.count() {
        if !used.holds(id) {
            *next = if id + 1 >= hi { lo } else { id + 1 };
            return Some(id);
        }
        id = if id + 1 >= hi { lo } else { id + 1 };
    }
    None
}

impl Ids for BTreeSet<u32> {
    fn count(&self) -> usize {
        self.len()
    }
    fn holds(&self, id: u32) -> bool {
        self.contains(&id)
    }
}

/// Numbers an ALLOC command hands out and its DEALLOC takes back (PDs, UAR pages, transport and XRC domains),
/// and the number the next ALLOC tries first, so a freed one is not reused at once.
#[derive(Debug)]
pub(crate) struct IdSet {
    set: BTreeSet<u32>,
    next: u32,
}

impl IdSet {
    pub(crate) fn new(first: u32) -> Self {
        Self { set: BTreeSet::new(), next: first }
    }

    /// Takes a free number in `lo..hi`; `None` when every one is taken.
    pub(crate) fn take(&mut self, lo: u32, hi: u32) -> Option<u32> {
        let id = alloc_id(&self.set, &mut self.next, lo, hi)?;
        self.set.insert(id);
        Some(id)
    }

    /// Gives `id` back; false when it was not taken.
    pub(crate) fn give_back(&mut self, id: u32) -> bool {
        self.set.remove(&id)
    }

    pub(crate) fn contains(&self, id: u32) -> bool {
        self.set.contains(&id)
    }

    pub(crate) fn len(&self) -> usize {
        self.set.len()
    }

    pub(crate) fn clear(&mut self) {
        self.set.clear();
    }
}
