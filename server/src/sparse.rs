//! Maps that give back their spare room. A `HashMap` keeps the capacity of its
//! largest moment; a burst of 20 000 contended names would otherwise leave the
//! server's per-name maps (waiters, handoff lines, subscriptions, limits, leases) at
//! their peak size for the rest of its life.

use std::collections::{HashMap, HashSet};
use std::hash::Hash;

/// Below this capacity a map is left as it is: small maps are cheap to keep.
const KEEP: usize = 1024;

/// Called after a removal: shrinks a map that is at most a quarter full to twice its
/// length, so the cost of shrinking is spread over the removals that made it sparse.
pub trait Sparse {
    /// Gives back the spare room of a mostly empty map.
    fn shrink_if_sparse(&mut self);
}

/// The capacity a map of `len` entries and `capacity` room should shrink to, if any.
fn shrunk(len: usize, capacity: usize) -> Option<usize> {
    (capacity > KEEP && len < capacity / 4).then(|| (len * 2).max(KEEP))
}

impl<K: Eq + Hash, V> Sparse for HashMap<K, V> {
    fn shrink_if_sparse(&mut self) {
        if let Some(to) = shrunk(self.len(), self.capacity()) {
            self.shrink_to(to);
        }
    }
}

impl<K: Eq + Hash> Sparse for HashSet<K> {
    fn shrink_if_sparse(&mut self) {
        if let Some(to) = shrunk(self.len(), self.capacity()) {
            self.shrink_to(to);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drained_map_gives_back_its_room_and_a_full_one_keeps_it() {
        let mut map: HashMap<u32, u32> = (0..100_000).map(|i| (i, i)).collect();
        let peak = map.capacity();
        for i in 0..99_000 {
            map.remove(&i);
            map.shrink_if_sparse();
        }
        assert_eq!(map.len(), 1000);
        assert!(
            map.capacity() <= peak / 16,
            "capacity {} of a peak {peak}",
            map.capacity()
        );
        let before = map.capacity();
        map.shrink_if_sparse();
        assert_eq!(map.capacity(), before, "a map that is not sparse keeps its room");
    }

    #[test]
    fn small_maps_are_left_alone() {
        assert_eq!(shrunk(2, KEEP), None);
        let mut set: HashSet<u32> = (0..500).collect();
        set.retain(|i| *i < 2);
        set.shrink_if_sparse();
        // Not shrunk to fit its 2 entries (its capacity may still read a little lower
        // after the removals: hashbrown counts the slots they left as used).
        assert!(set.capacity() >= 300, "capacity {}", set.capacity());
    }
}
