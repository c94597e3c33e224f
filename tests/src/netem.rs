//! A userspace network impairment proxy for UDP (issue 58): every cluster
//! link is QUIC over UDP, and this kernel has no `netem` qdisc, so a test
//! puts a [`Link`] between two processes (a worker dials the link's address
//! instead of the coordinator's, a stage the link's instead of the next
//! stage's) and the link delays, jitters, loses (also in bursts),
//! reorders, duplicates and rate-limits the datagrams each way, and cuts
//! and restores the whole link on command.
//!
//! Each direction draws its faults from its own generator seeded from the
//! link's seed, so a failing run replays the same fault sequence for the
//! same packet sequence; every cut, restore and profile change is logged
//! with its time since the link started, and each packet's fate is counted.
//! `tinyvllm-netem` (src/bin/netem.rs) runs one link as a process, for
//! `tools/soak.py --faults`.

use std::collections::{BinaryHeap, HashMap};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What a link does to each direction's datagrams.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Profile {
    /// One-way delay.
    pub delay: Duration,
    /// Each datagram's delay is `delay` plus a uniform draw in `[-jitter,
    /// +jitter]`, but never before the datagram sent ahead of it: a link
    /// is a queue, and jitter that overtakes (Linux netem's) would make
    /// every burst look like heavy reordering, which a LAN does not do.
    /// `reorder` reorders.
    pub jitter: Duration,
    /// Probability a datagram is lost (in the good state, with `burst`).
    pub loss: f64,
    /// Gilbert-Elliott bursts: `(p_enter, p_leave)`, the per-datagram
    /// chances of entering and leaving a bad state in which every datagram
    /// is lost.
    pub burst: Option<(f64, f64)>,
    /// Probability a datagram is held back by an extra `2 * delay + 1 ms`, so later ones overtake it.
    pub reorder: f64,
    /// Probability a datagram is delivered twice.
    pub duplicate: f64,
    /// Bytes per second the link carries (`None`: unlimited); a datagram
    /// that would wait over [`MAX_QUEUE_DELAY`] behind others is dropped.
    pub rate: Option<u64>,
}

/// The longest a datagram queues behind others on a rate-limited link.
pub const MAX_QUEUE_DELAY: Duration = Duration::from_millis(200);

impl Profile {
    /// `delay`, `jitter` and `loss`, nothing else: the common case.
    pub fn lossy(delay_ms: u64, jitter_ms: u64, loss: f64) -> Self {
        Self {
            delay: Duration::from_millis(delay_ms),
            jitter: Duration::from_millis(jitter_ms),
            loss,
            ..Self::default()
        }
    }

    /// Parses `key=value` words (`delay_ms=10 jitter_ms=5 loss=0.02
    /// burst=0.01,0.3 reorder=0.01 duplicate=0.01 rate_mbps=100`) over `self`.
    pub fn apply(&mut self, words: &str) -> Result<(), String> {
        for word in words.split_whitespace() {
            let (key, value) = word.split_once('=').ok_or_else(|| format!("{word:?}: expected key=value"))?;
            let number = || value.parse::<f64>().map_err(|e| format!("{word:?}: {e}"));
            let probability = || {
                number()
                    .and_then(|p| if (0.0..=1.0).contains(&p) { Ok(p) } else { Err(format!("{word:?}: not in 0..1")) })
            };
            match key {
                "delay_ms" => self.delay = Duration::from_secs_f64(number()?.max(0.0) / 1e3),
                "jitter_ms" => self.jitter = Duration::from_secs_f64(number()?.max(0.0) / 1e3),
                "loss" => self.loss = probability()?,
                "reorder" => self.reorder = probability()?,
                "duplicate" => self.duplicate = probability()?,
                "rate_mbps" => self.rate = Some((number()? * 1e6 / 8.0) as u64).filter(|&r| r > 0),
                "burst" => {
                    let (a, b) = value.split_once(',').ok_or_else(|| format!("{word:?}: expected P_ENTER,P_LEAVE"))?;
                    let p = |s: &str| s.parse::<f64>().map_err(|e| format!("{word:?}: {e}"));
                    self.burst = Some((p(a)?, p(b)?));
                }
                other => return Err(format!("unknown setting {other:?}")),
            }
        }
        Ok(())
    }
}

/// What happened to the datagrams so far, both directions together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub forwarded: u64,
    pub lost: u64,
    pub cut: u64,
    pub queue_drops: u64,
    pub duplicated: u64,
    pub reordered: u64,
}

/// A proxy between the datagrams sent to [`Link::address`] and `target`.
pub struct Link {
    address: SocketAddr,
    shared: Arc<Shared>,
}

struct Shared {
    name: String,
    started: Instant,
    target: SocketAddr,
    front: UdpSocket,
    profile: Mutex<Profile>,
    cut: AtomicBool,
    stop: AtomicBool,
    /// Per direction (0 towards the target, 1 back): generator and burst state.
    dice: [Mutex<Dice>; 2],
    /// When each direction's line is next free (rate limit).
    line_free: [Mutex<Instant>; 2],
    /// When each direction last delivers a datagram in order.
    last_due: [Mutex<Instant>; 2],
    queue: Mutex<BinaryHeap<Scheduled>>,
    wake: Condvar,
    log: Mutex<Vec<String>>,
    counts: [AtomicU64; 6],
    sequence: AtomicU64,
}

struct Dice {
    state: u64,
    bad: bool,
}

impl Dice {
    /// splitmix64: small, seedable, good enough for fault draws.
    fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

struct Scheduled {
    due: Instant,
    sequence: u64,
    socket: Arc<UdpSocket>,
    /// `None`: the socket is connected.
    to: Option<SocketAddr>,
    bytes: Vec<u8>,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.due, self.sequence) == (other.due, other.sequence)
    }
}
impl Eq for Scheduled {}
impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Scheduled {
    /// Earliest first (the heap is a max-heap).
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (other.due, other.sequence).cmp(&(self.due, self.sequence))
    }
}

const FORWARDED: usize = 0;
const LOST: usize = 1;
const CUT: usize = 2;
const QUEUE_DROPS: usize = 3;
const DUPLICATED: usize = 4;
const REORDERED: usize = 5;

impl Link {
    /// Listens on `listen` (port 0 picks one) and forwards to `target`,
    /// impaired by `profile` with faults drawn from `seed`.
    pub fn start(
        name: &str,
        listen: SocketAddr,
        target: SocketAddr,
        profile: Profile,
        seed: u64,
    ) -> std::io::Result<Self> {
        let front = UdpSocket::bind(listen)?;
        front.set_read_timeout(Some(Duration::from_millis(100)))?;
        let address = front.local_addr()?;
        let now = Instant::now();
        let shared = Arc::new(Shared {
            name: name.to_string(),
            started: now,
            target,
            front,
            profile: Mutex::new(profile.clone()),
            cut: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            dice: [
                Mutex::new(Dice { state: seed ^ 0x5eed_0001, bad: false }),
                Mutex::new(Dice { state: seed ^ 0x5eed_0002, bad: false }),
            ],
            line_free: [Mutex::new(now), Mutex::new(now)],
            last_due: [Mutex::new(now), Mutex::new(now)],
            queue: Mutex::new(BinaryHeap::new()),
            wake: Condvar::new(),
            log: Mutex::new(Vec::new()),
            counts: Default::default(),
            sequence: AtomicU64::new(0),
        });
        shared.note(format!("{name}: {address} -> {target}, {profile:?}, seed {seed}"));
        let front_thread = shared.clone();
        std::thread::Builder::new().name(format!("netem-{name}-in")).spawn(move || front_thread.pump_front())?;
        let sender = shared.clone();
        std::thread::Builder::new().name(format!("netem-{name}-out")).spawn(move || sender.pump_queue())?;
        Ok(Self { address, shared })
    }

    /// Where to send datagrams meant for the target.
    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// Drops every datagram, both ways, until [`Link::restore`].
    pub fn cut(&self) {
        if !self.shared.cut.swap(true, Ordering::SeqCst) {
            self.shared.note("cut".into());
        }
    }

    pub fn restore(&self) {
        if self.shared.cut.swap(false, Ordering::SeqCst) {
            self.shared.note("restored".into());
        }
    }

    pub fn profile(&self) -> Profile {
        self.shared.profile.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_profile(&self, profile: Profile) {
        self.shared.note(format!("profile {profile:?}"));
        *self.shared.profile.lock().unwrap_or_else(|p| p.into_inner()) = profile;
    }

    pub fn counts(&self) -> Counts {
        let c = |i: usize| self.shared.counts[i].load(Ordering::Relaxed);
        Counts {
            forwarded: c(FORWARDED),
            lost: c(LOST),
            cut: c(CUT),
            queue_drops: c(QUEUE_DROPS),
            duplicated: c(DUPLICATED),
            reordered: c(REORDERED),
        }
    }

    /// The fault log: cuts, restores and profile changes, each with its time.
    pub fn log(&self) -> Vec<String> {
        self.shared.log.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.wake.notify_all();
    }
}

impl Shared {
    fn note(&self, line: String) {
        let line = format!("[{:>9.3}s] {}: {line}", self.started.elapsed().as_secs_f64(), self.name);
        self.log.lock().unwrap_or_else(|p| p.into_inner()).push(line);
    }

    /// Datagrams from clients: each client gets an upstream socket of its
    /// own (so the target's answers find their way back), with a thread
    /// reading that socket.
    fn pump_front(self: Arc<Self>) {
        let mut upstream: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
        let mut buf = vec![0u8; 65536];
        while !self.stop.load(Ordering::SeqCst) {
            let Ok((n, client)) = self.front.recv_from(&mut buf) else { continue };
            let socket = match upstream.get(&client) {
                Some(socket) => socket.clone(),
                None => {
                    let any: SocketAddr =
                        if self.target.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }.parse().expect("literal");
                    let Ok(socket) = UdpSocket::bind(any).and_then(|s| s.connect(self.target).map(|()| s)) else {
                        continue;
                    };
                    let _ = socket.set_read_timeout(Some(Duration::from_millis(100)));
                    let socket = Arc::new(socket);
                    upstream.insert(client, socket.clone());
                    let back = self.clone();
                    let reader = socket.clone();
                    let _ = std::thread::Builder::new()
                        .name(format!("netem-{}-back", self.name))
                        .spawn(move || back.pump_back(reader, client));
                    socket
                }
            };
            self.schedule(0, &buf[..n], socket, None);
        }
    }

    /// Datagrams from the target to `client`.
    fn pump_back(self: Arc<Self>, socket: Arc<UdpSocket>, client: SocketAddr) {
        let mut buf = vec![0u8; 65536];
        let front = match self.front.try_clone() {
            Ok(front) => Arc::new(front),
            Err(_) => return,
        };
        while !self.stop.load(Ordering::SeqCst) {
            let Ok(n) = socket.recv(&mut buf) else { continue };
            self.schedule(1, &buf[..n], front.clone(), Some(client));
        }
    }

    /// Decides a datagram's fate and queues its copies.
    fn schedule(&self, direction: usize, bytes: &[u8], socket: Arc<UdpSocket>, to: Option<SocketAddr>) {
        if self.cut.load(Ordering::SeqCst) {
            self.counts[CUT].fetch_add(1, Ordering::Relaxed);
            return;
        }
        let profile = self.profile.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let now = Instant::now();
        let (lost, reorder, delays) = {
            let mut dice = self.dice[direction].lock().unwrap_or_else(|p| p.into_inner());
            if let Some((enter, leave)) = profile.burst {
                let flip = dice.unit();
                dice.bad = if dice.bad { flip >= leave } else { flip < enter };
            }
            let lost = dice.bad || dice.unit() < profile.loss;
            let delay = |dice: &mut Dice, extra: Duration| {
                let jitter = profile.jitter.as_secs_f64() * (2.0 * dice.unit() - 1.0);
                Duration::from_secs_f64((profile.delay.as_secs_f64() + jitter).max(0.0)) + extra
            };
            let reorder = dice.unit() < profile.reorder;
            let held = if reorder { profile.delay * 2 + Duration::from_millis(1) } else { Duration::ZERO };
            let first = delay(&mut dice, held);
            let duplicate = dice.unit() < profile.duplicate;
            let second = duplicate.then(|| delay(&mut dice, Duration::from_micros(100)));
            if reorder {
                self.counts[REORDERED].fetch_add(1, Ordering::Relaxed);
            }
            (lost, reorder, std::iter::once(first).chain(second).collect::<Vec<_>>())
        };
        if lost {
            self.counts[LOST].fetch_add(1, Ordering::Relaxed);
            return;
        }
        // The rate limit: the datagram leaves when the line is free.
        let sent = match profile.rate {
            Some(rate) => {
                let mut free = self.line_free[direction].lock().unwrap_or_else(|p| p.into_inner());
                let start = (*free).max(now);
                if start.saturating_duration_since(now) > MAX_QUEUE_DELAY {
                    self.counts[QUEUE_DROPS].fetch_add(1, Ordering::Relaxed);
                    return;
                }
                *free = start + Duration::from_secs_f64(bytes.len() as f64 / rate as f64);
                *free
            }
            None => now,
        };
        if delays.len() > 1 {
            self.counts[DUPLICATED].fetch_add(1, Ordering::Relaxed);
        }
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        for delay in delays {
            let mut due = sent + delay;
            if !reorder {
                // In order behind the datagram before it.
                let mut last = self.last_due[direction].lock().unwrap_or_else(|p| p.into_inner());
                due = due.max(*last);
                *last = due;
            }
            queue.push(Scheduled {
                due,
                sequence: self.sequence.fetch_add(1, Ordering::Relaxed),
                socket: socket.clone(),
                to,
                bytes: bytes.to_vec(),
            });
        }
        drop(queue);
        self.wake.notify_one();
    }

    /// Sends each queued datagram when it is due.
    fn pump_queue(self: Arc<Self>) {
        let mut queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        while !self.stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            match queue.peek().map(|s| s.due) {
                Some(due) if due <= now => {
                    let Some(item) = queue.pop() else { continue };
                    drop(queue);
                    let sent = match item.to {
                        Some(to) => item.socket.send_to(&item.bytes, to),
                        None => item.socket.send(&item.bytes),
                    };
                    if sent.is_ok() {
                        self.counts[FORWARDED].fetch_add(1, Ordering::Relaxed);
                    }
                    queue = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                }
                Some(due) => {
                    queue = self.wake.wait_timeout(queue, due - now).unwrap_or_else(|p| p.into_inner()).0;
                }
                None => {
                    queue =
                        self.wake.wait_timeout(queue, Duration::from_millis(100)).unwrap_or_else(|p| p.into_inner()).0;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echo() -> (UdpSocket, SocketAddr) {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        let address = socket.local_addr().unwrap();
        let server = socket.try_clone().unwrap();
        std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while let Ok((n, from)) = server.recv_from(&mut buf) {
                let _ = server.send_to(&buf[..n], from);
            }
        });
        (socket, address)
    }

    fn client(link: &Link) -> UdpSocket {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.connect(link.address()).unwrap();
        socket.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        socket
    }

    /// Round trips through the link take twice its delay; a cut drops
    /// everything until restored.
    #[test]
    fn delays_and_cuts() {
        let (_server, target) = echo();
        let link = Link::start("t", "127.0.0.1:0".parse().unwrap(), target, Profile::lossy(20, 0, 0.0), 1).unwrap();
        let c = client(&link);
        let t0 = Instant::now();
        c.send(b"ping").unwrap();
        let mut buf = [0u8; 16];
        assert_eq!(c.recv(&mut buf).unwrap(), 4);
        assert!(t0.elapsed() >= Duration::from_millis(40), "{:?}", t0.elapsed());
        link.cut();
        c.send(b"lost").unwrap();
        assert!(c.recv(&mut buf).is_err());
        link.restore();
        c.send(b"back").unwrap();
        let n = c.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"back");
        let log = link.log().join("\n");
        assert!(log.contains("cut") && log.contains("restored"), "{log}");
        assert_eq!(link.counts().cut, 1);
    }

    /// Loss, duplication and reordering happen at about their rates, and
    /// the same seed gives the same fates.
    #[test]
    fn faults_follow_their_rates_and_the_seed() {
        let fates = |seed| {
            let (_server, target) = echo();
            let profile = Profile { loss: 0.2, duplicate: 0.1, ..Profile::default() };
            let link = Link::start("t", "127.0.0.1:0".parse().unwrap(), target, profile, seed).unwrap();
            let c = client(&link);
            for i in 0..500u32 {
                c.send(&i.to_le_bytes()).unwrap();
                std::thread::sleep(Duration::from_micros(200));
            }
            std::thread::sleep(Duration::from_millis(200));
            link.counts()
        };
        let a = fates(7);
        // Both directions draw: 500 datagrams out, then ~440 echoes of
        // those that arrived (duplicates included): ~190 lost.
        assert!((140..=240).contains(&a.lost), "{a:?}");
        assert!(a.duplicated > 20, "{a:?}");
        let b = fates(7);
        assert_eq!((a.lost, a.duplicated), (b.lost, b.duplicated), "the same seed");
    }

    #[test]
    fn profiles_parse_from_words() {
        let mut p = Profile::default();
        p.apply("delay_ms=10 jitter_ms=5 loss=0.02 burst=0.01,0.3 reorder=0.01 duplicate=0.005 rate_mbps=80").unwrap();
        assert_eq!(p.delay, Duration::from_millis(10));
        assert_eq!(p.burst, Some((0.01, 0.3)));
        assert_eq!(p.rate, Some(10_000_000));
        assert!(p.apply("loss=2").is_err() && p.apply("speed=1").is_err() && p.apply("loss").is_err());
    }
}
