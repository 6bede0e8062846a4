//! Containers shaped for the datapath's work per WQE.
//!
//! [`Small`]: a short list kept inline, spilling to the heap beyond `N` entries. The datapath's per-WQE lists
//! (SGEs, the pieces a memory key translates a range into) are almost always one or two entries long; a heap
//! allocation for each would cost more than the work done with them.
//!
//! [`IdMap`]: objects by number (QPs, CQs, memory keys). The datapath looks several of them up per WQE, so a
//! lookup is an index into a power-of-two table by the number's low bits, probing linearly from there. Firmware
//! hands numbers out in sequence, so live objects rarely share low bits and a lookup is one probe. The numbers
//! are also kept sorted, for the walks in number order the device makes.

use std::fmt;
use std::ops::{Deref, DerefMut};

#[derive(Debug, Clone)]
pub(crate) enum Small<T: Copy + Default, const N: usize> {
    Inline { items: [T; N], len: usize },
    Heap(Vec<T>),
}

impl<T: Copy + Default, const N: usize> Small<T, N> {
    pub(crate) fn new() -> Self {
        Small::Inline { items: [T::default(); N], len: 0 }
    }

    /// Empties the list, keeping a spilled one's heap buffer.
    #[inline]
    pub(crate) fn clear(&mut self) {
        match self {
            Small::Inline { len, .. } => *len = 0,
            Small::Heap(h) => h.clear(),
        }
    }

    /// Appends a default entry and returns it, to be filled in place: a value built apart and then pushed is
    /// copied whole right after its fields were written, a copy the CPU stalls on.
    #[inline]
    pub(crate) fn push_slot(&mut self) -> &mut T {
        match self {
            Small::Inline { items, len } if *len < N => {
                items[*len] = T::default();
                *len += 1;
            }
            _ => self.push(T::default()),
        }
        let last = self.len() - 1;
        &mut self[last]
    }

    #[inline]
    pub(crate) fn push(&mut self, v: T) {
        match self {
            Small::Inline { items, len } if *len < N => {
                items[*len] = v;
                *len += 1;
            }
            Small::Inline { items, len } => {
                let h = Self::spill(&items[..*len], v);
                *self = Small::Heap(h);
            }
            Small::Heap(h) => h.push(v),
        }
    }
}

impl<T: Copy + Default, const N: usize> Small<T, N> {
    #[cold]
    fn spill(items: &[T], v: T) -> Vec<T> {
        let mut h = Vec::with_capacity(2 * N);
        h.extend_from_slice(items);
        h.push(v);
        h
    }
}

impl<T: Copy + Default, const N: usize> Default for Small<T, N> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Copy + Default, const N: usize> Deref for Small<T, N> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            Small::Inline { items, len } => &items[..*len],
            Small::Heap(h) => h,
        }
    }
}

impl<T: Copy + Default, const N: usize> DerefMut for Small<T, N> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            Small::Inline { items, len } => &mut items[..*len],
            Small::Heap(h) => h,
        }
    }
}

impl<T: Copy + Default + PartialEq, const N: usize> PartialEq for Small<T, N> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Copy + Default + Eq, const N: usize> Eq for Small<T, N> {}

/// Objects by number; see the module documentation. The same methods as the ordered map it replaces, iteration
/// in ascending number order included.
pub(crate) struct IdMap<V> {
    /// Entries at the slot their number's low bits name, or after it (linear probing); at most half the slots are
    /// used, so every probe ends at an empty slot.
    slots: Vec<Option<(u32, V)>>,
    /// The live numbers, ascending.
    order: Vec<u32>,
    /// The farthest any entry has been placed from its home slot since the table was last rebuilt: a deletion
    /// looks no farther than this past the hole for entries to move back, so removing one of many numbers in
    /// sequence (one long run of used slots, each entry at home) is one step, not a walk of the run.
    max_disp: usize,
}

/// The table's first size.
const IDMAP_MIN_SLOTS: usize = 8;

impl<V> IdMap<V> {
    pub(crate) fn new() -> Self {
        Self { slots: Vec::new(), order: Vec::new(), max_disp: 0 }
    }

    pub(crate) fn len(&self) -> usize {
        self.order.len()
    }

    /// The slot holding `id`.
    #[inline]
    fn find(&self, id: u32) -> Option<usize> {
        let mask = self.slots.len().checked_sub(1)?;
        let mut i = id as usize & mask;
        // Bounded: the table is never full, and an empty slot ends the probe.
        for _ in 0..self.slots.len() {
            match &self.slots[i] {
                None => return None,
                Some((k, _)) if *k == id => return Some(i),
                Some(_) => i = (i + 1) & mask,
            }
        }
        None
    }

    #[inline]
    pub(crate) fn get(&self, id: &u32) -> Option<&V> {
        let i = self.find(*id)?;
        self.slots[i].as_ref().map(|(_, v)| v)
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, id: &u32) -> Option<&mut V> {
        let i = self.find(*id)?;
        self.slots[i].as_mut().map(|(_, v)| v)
    }

    pub(crate) fn contains_key(&self, id: &u32) -> bool {
        self.find(*id).is_some()
    }

    /// Inserts `v` as `id`; returns the value it replaces.
    pub(crate) fn insert(&mut self, id: u32, v: V) -> Option<V> {
        if let Some(old) = self.get_mut(&id) {
            return Some(std::mem::replace(old, v));
        }
        if (self.order.len() + 1) * 2 > self.slots.len() {
            self.grow();
        }
        self.place(id, v);
        if let Err(at) = self.order.binary_search(&id) {
            self.order.insert(at, id);
        }
        None
    }

    /// Puts an entry whose number is not in the table at the first free slot of its probe.
    fn place(&mut self, id: u32, v: V) {
        let mask = self.slots.len() - 1;
        let home = id as usize & mask;
        let mut i = home;
        // Bounded: the table is at most half full.
        while self.slots[i].is_some() {
            i = (i + 1) & mask;
        }
        self.max_disp = self.max_disp.max(i.wrapping_sub(home) & mask);
        self.slots[i] = Some((id, v));
    }

    /// Doubles the table and places every entry again.
    fn grow(&mut self) {
        let size = (self.slots.len() * 2).max(IDMAP_MIN_SLOTS);
        let old = std::mem::replace(&mut self.slots, std::iter::repeat_with(|| None).take(size).collect());
        self.max_disp = 0;
        for (id, v) in old.into_iter().flatten() {
            self.place(id, v);
        }
    }

    pub(crate) fn remove(&mut self, id: &u32) -> Option<V> {
        let mut hole = self.find(*id)?;
        let (_, v) = self.slots[hole].take()?;
        // Entries after the hole whose probe passes through it move back into it, so no probe stops early at the
        // hole (backward-shift deletion; no tombstones).
        let mask = self.slots.len() - 1;
        let mut j = hole;
        // Bounded: the run of used slots after the hole ends at an empty one.
        for _ in 0..self.slots.len() {
            j = (j + 1) & mask;
            // An entry this far past the hole sits at most `max_disp` from its home, so its home is after the
            // hole: it, and every one after it, stays.
            if j.wrapping_sub(hole) & mask > self.max_disp {
                break;
            }
            let home = match &self.slots[j] {
                None => break,
                Some((k, _)) => *k as usize & mask,
            };
            if j.wrapping_sub(home) & mask >= j.wrapping_sub(hole) & mask {
                self.slots[hole] = self.slots[j].take();
                hole = j;
            }
        }
        if let Ok(at) = self.order.binary_search(id) {
            self.order.remove(at);
        }
        Some(v)
    }

    pub(crate) fn clear(&mut self) {
        self.slots.clear();
        self.order.clear();
        self.max_disp = 0;
    }

    /// The `i`-th live number in ascending order.
    #[cfg(test)]
    pub(crate) fn key_at(&self, i: usize) -> Option<u32> {
        self.order.get(i).copied()
    }

    /// Entries in ascending number order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u32, &V)> + '_ {
        self.order.iter().filter_map(move |&id| self.get(&id).map(|v| (id, v)))
    }

    /// Values in ascending number order.
    pub(crate) fn values(&self) -> impl Iterator<Item = &V> + '_ {
        self.iter().map(|(_, v)| v)
    }
}

impl<V> Default for IdMap<V> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V: fmt::Debug> fmt::Debug for IdMap<V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spills_past_n_and_keeps_order() {
        let mut s: Small<u32, 2> = Small::new();
        assert!(s.is_empty());
        for v in 0..5 {
            s.push(v);
        }
        assert_eq!(&*s, &[0, 1, 2, 3, 4]);
        assert!(matches!(s, Small::Heap(_)));
        let mut t: Small<u32, 2> = Small::default();
        t.push(7);
        t[0] += 1;
        assert_eq!((&*t, t.clone() == t), (&[8][..], true));
        s.clear();
        t.clear();
        s.push(9);
        *t.push_slot() = 3;
        assert_eq!((&*s, &*t), (&[9][..], &[3][..]));
    }

    #[test]
    fn id_map_matches_an_ordered_map_through_inserts_and_removes() {
        use std::collections::BTreeMap;
        let mut m: IdMap<u64> = IdMap::new();
        let mut want = BTreeMap::new();
        // Numbers that share low bits (and wrap the probe around the table's end) alongside sequential ones.
        let mut x = 0x9e37_79b9u32;
        for step in 0..4000u32 {
            x = x.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            let id = match step % 3 {
                0 => 0x100 + step % 64,
                1 => (x >> 8) % 48 * 16 + 7,
                _ => x % 40,
            };
            if x >> 31 == 0 {
                assert_eq!(m.insert(id, u64::from(step)), want.insert(id, u64::from(step)));
            } else {
                assert_eq!(m.remove(&id), want.remove(&id));
            }
            assert_eq!(m.len(), want.len());
            if step % 97 == 0 {
                for probe in 0..0x200 {
                    assert_eq!(m.get(&probe), want.get(&probe), "{probe}");
                }
                assert!(m.iter().map(|(k, v)| (k, *v)).eq(want.iter().map(|(k, v)| (*k, *v))));
                assert_eq!(m.key_at(0), want.keys().next().copied());
            }
        }
        if let Some(v) = m.get_mut(&0x100) {
            *v = 9;
        }
        assert_eq!(m.contains_key(&0x100), want.contains_key(&0x100));
        m.clear();
        assert!(m.len() == 0 && m.get(&0x100).is_none() && m.key_at(0).is_none());
    }
}
