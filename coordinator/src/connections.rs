//! The HTTP connection cap. Each open connection holds a slot; when all
//! are taken, a new connection takes the slot of the oldest idle one (no
//! request in progress: a client sending its head slowly, or a keep-alive
//! connection between requests), which is closed. Only when every slot
//! serves a request is the new connection refused. So a flood of
//! half-sent requests can hold at most the slots nobody else needs, and a
//! probe like `/health` still gets in.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::Notify;

/// One connection's state as the cap sees it.
#[derive(Default)]
pub struct Slot {
    /// Requests being answered on this connection (0: idle).
    busy: AtomicUsize,
    evicted: Notify,
    /// Notified when the connection's task let go of it (its socket closed).
    closed: Notify,
}

impl Slot {
    /// Marks a request in progress until the returned guard drops.
    pub fn busy(self: &Arc<Self>) -> Busy {
        self.busy.fetch_add(1, Ordering::Relaxed);
        Busy(self.clone())
    }

    /// Resolves when the cap takes this connection's slot for a newer one.
    pub async fn evicted(&self) {
        self.evicted.notified().await;
    }

    /// Resolves once the connection is closed (its `Admitted` dropped).
    pub async fn closed(&self) {
        self.closed.notified().await;
    }
}

/// A request in progress on a connection (dropped with its response body).
pub struct Busy(Arc<Slot>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.busy.fetch_sub(1, Ordering::Relaxed);
    }
}

pub struct Connections {
    max: usize,
    open: Mutex<Open>,
}

#[derive(Default)]
struct Open {
    next: u64,
    slots: BTreeMap<u64, Arc<Slot>>,
}

/// A connection's hold on its slot, released on drop.
pub struct Admitted {
    connections: Arc<Connections>,
    key: u64,
    pub slot: Arc<Slot>,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.connections.lock().slots.remove(&self.key);
        self.slot.closed.notify_one();
    }
}

/// What admitting a connection did.
pub enum Admission {
    Admitted(Admitted),
    /// Admitted in the place of an idle connection (the second), now told
    /// to close: wait for it before accepting more, or descriptors pile up.
    Evicted(Admitted, Arc<Slot>),
    /// Every slot serves a request.
    Full,
}

impl Connections {
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self { max: max.max(1), open: Mutex::new(Open::default()) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Open> {
        self.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn open(&self) -> usize {
        self.lock().slots.len()
    }

    pub fn admit(self: &Arc<Self>) -> Admission {
        let mut open = self.lock();
        let mut evicted = None;
        if open.slots.len() >= self.max {
            // Keys grow with time: the first idle one is the oldest.
            let idle = open.slots.iter().find(|(_, s)| s.busy.load(Ordering::Relaxed) == 0).map(|(&k, _)| k);
            let Some(slot) = idle.and_then(|k| open.slots.remove(&k)) else { return Admission::Full };
            slot.evicted.notify_one();
            evicted = Some(slot);
        }
        let key = open.next;
        open.next += 1;
        let slot = Arc::new(Slot::default());
        open.slots.insert(key, slot.clone());
        let admitted = Admitted { connections: self.clone(), key, slot };
        match evicted {
            Some(old) => Admission::Evicted(admitted, old),
            None => Admission::Admitted(admitted),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(a: Admission) -> Admitted {
        match a {
            Admission::Admitted(a) | Admission::Evicted(a, _) => a,
            Admission::Full => panic!("refused"),
        }
    }

    #[test]
    fn the_oldest_idle_connection_makes_room_and_busy_ones_are_kept() {
        let c = Connections::new(2);
        let first = admitted(c.admit());
        let second = admitted(c.admit());
        let _busy = first.slot.busy();
        // `first` serves a request: `second` is the one evicted.
        let third = c.admit();
        assert!(matches!(third, Admission::Evicted(..)));
        assert_eq!(c.open(), 2);
        drop(second); // its task ends: the slot was already taken over
        assert_eq!(c.open(), 2);
        let third = admitted(third);
        let _b = third.slot.busy();
        assert!(matches!(c.admit(), Admission::Full), "every slot serves a request");
        drop(first);
        assert_eq!(c.open(), 1);
    }
}
