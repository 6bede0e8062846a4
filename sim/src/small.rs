//! A short list kept inline, spilling to the heap beyond `N` entries. The datapath's per-WQE lists (SGEs, the
//! pieces a memory key translates a range into) are almost always one or two entries long; a heap allocation for
//! each would cost more than the work done with them.

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
    }
}
