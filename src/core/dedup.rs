//! A bounded set of recently seen event ids (oldest forgotten first).

use std::collections::{HashSet, VecDeque};

use nostr::event::EventId;

/// Remembers at most `capacity` ids; inserting more forgets the oldest.
#[derive(Debug, Clone)]
pub struct RecentIds {
    set: HashSet<EventId>,
    order: VecDeque<EventId>,
    capacity: usize,
}

impl RecentIds {
    /// An empty set that keeps at most `capacity` ids (at least 1).
    pub fn new(capacity: usize) -> RecentIds {
        RecentIds {
            set: HashSet::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// True if `id` is remembered.
    pub fn contains(&self, id: &EventId) -> bool {
        self.set.contains(id)
    }

    /// Remembers `id`; returns false if it was already there.
    pub fn insert(&mut self, id: EventId) -> bool {
        if !self.set.insert(id) {
            return false;
        }
        self.order.push_back(id);
        while self.order.len() > self.capacity {
            if let Some(old) = self.order.pop_front() {
                self.set.remove(&old);
            }
        }
        true
    }

    /// Forgets `id`.
    pub fn remove(&mut self, id: &EventId) {
        if self.set.remove(id) {
            self.order.retain(|x| x != id);
        }
    }

    /// Number of remembered ids.
    pub fn len(&self) -> usize {
        self.set.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.set.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_fifo() {
        let mut r = RecentIds::new(3);
        let id = |b: u8| EventId::from_byte_array([b; 32]);
        assert!(r.insert(id(1)));
        assert!(!r.insert(id(1)));
        r.insert(id(2));
        r.insert(id(3));
        r.insert(id(4));
        assert_eq!(r.len(), 3);
        assert!(!r.contains(&id(1)));
        assert!(r.contains(&id(4)));
        r.remove(&id(3));
        assert!(!r.contains(&id(3)));
        assert_eq!(r.len(), 2);
    }
}
