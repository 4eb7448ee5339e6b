//! Which handshake in flight a new connection sheds, as pure state with the
//! time passed in as `now` ([`Handshakes`]), and whom the per-peer cap
//! counts a connection against ([`PeerKey`]).
//!
//! A handshake progresses twice before it completes: at its accept, and
//! when its whole ClientHello has arrived. The one shed is the one that has
//! gone longest without progress: a connection that sent its ClientHello
//! and then stalled is shed before a fresh connect once it has stalled
//! longer than that connect's age, and a silent one before a client that
//! sent its ClientHello after it was accepted. A real client's handshake
//! takes a few round trips, so it never goes [`STALLED_AFTER`] without
//! progress; whatever has is counted as stalled when shed. A handshake the
//! listener's cap sheds before that tells that more connects came in than
//! the cap holds for a real client's round trips ([`Shedding::stalled`]).
//!
//! The per-peer cap counts IPv4 peers by address and IPv6 peers by their
//! /64: one host is usually given a whole /64, so its exact address would
//! let it take as many places as it has addresses. An IPv4-mapped IPv6
//! address counts as the IPv4 address it maps.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::time::{Duration, Instant};

/// How long a handshake goes without progress before it counts as stalled:
/// far longer than a real client's round trips between its connect, its
/// ClientHello and its Finished.
pub const STALLED_AFTER: Duration = Duration::from_secs(1);

/// Whom the per-peer cap counts a connection against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum PeerKey {
    /// An IPv4 address (or an IPv4-mapped IPv6 one), exactly.
    V4(Ipv4Addr),
    /// An IPv6 address's /64: its first 64 bits.
    V6Prefix(u64),
}

impl PeerKey {
    /// The key of a connection from `ip`.
    pub fn of(ip: IpAddr) -> Self {
        match ip.to_canonical() {
            IpAddr::V4(v4) => Self::V4(v4),
            IpAddr::V6(v6) => Self::V6Prefix((u128::from(v6) >> 64) as u64),
        }
    }
}

/// The caps: handshakes in flight on the listener, and from one peer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Caps {
    pub total: usize,
    pub per_peer: usize,
}

/// Which cap shed a handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cap {
    /// The listener's: the handshake that had gone longest without
    /// progress among all.
    Listener,
    /// The new connection's peer's: the longest without progress among
    /// that peer's.
    Peer,
}

/// A handshake shed to make room for a new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Shedding {
    pub id: u64,
    pub cap: Cap,
    /// Whether it had gone [`STALLED_AFTER`] without progress. If not, and
    /// the listener's cap shed it, more connects are coming in than the
    /// cap holds for a real client's round trips: real clients may be shed
    /// with the rest.
    pub stalled: bool,
}

/// One handshake in flight.
#[derive(Debug, Clone, Copy)]
struct Entry {
    peer: PeerKey,
    /// Its last progress: the accept, then the whole ClientHello.
    progressed: Instant,
}

/// The handshakes in flight on one listener, by their last progress.
#[derive(Debug)]
pub(crate) struct Handshakes {
    caps: Caps,
    next: u64,
    entries: HashMap<u64, Entry>,
    /// All of them, longest without progress first (ties: the first admitted).
    by_progress: BTreeSet<(Instant, u64)>,
    /// Likewise, each peer's.
    by_peer: HashMap<PeerKey, BTreeSet<(Instant, u64)>>,
}

impl Handshakes {
    /// None in flight; caps of 0 count as 1.
    pub fn new(caps: Caps) -> Self {
        let caps = Caps { total: caps.total.max(1), per_peer: caps.per_peer.max(1) };
        Self { caps, next: 0, entries: HashMap::new(), by_progress: BTreeSet::new(), by_peer: HashMap::new() }
    }

    /// Handshakes in flight.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Admits a connection from `peer` accepted at `now`: its id, and the
    /// handshakes shed to make room (already forgotten).
    pub fn admit(&mut self, peer: IpAddr, now: Instant) -> (u64, Vec<Shedding>) {
        let peer = PeerKey::of(peer);
        let mut shed = Vec::new();
        let peer_victim = self
            .by_peer
            .get(&peer)
            .filter(|ids| ids.len() >= self.caps.per_peer)
            .and_then(|ids| ids.first().copied());
        if let Some(victim) = peer_victim {
            shed.push(self.shed(victim, Cap::Peer, now));
        }
        if self.entries.len() >= self.caps.total {
            if let Some(victim) = self.by_progress.first().copied() {
                shed.push(self.shed(victim, Cap::Listener, now));
            }
        }
        let id = self.next;
        self.next += 1;
        self.entries.insert(id, Entry { peer, progressed: now });
        self.by_progress.insert((now, id));
        self.by_peer.entry(peer).or_default().insert((now, id));
        (id, shed)
    }

    fn shed(&mut self, (progressed, id): (Instant, u64), cap: Cap, now: Instant) -> Shedding {
        self.remove(id);
        Shedding { id, cap, stalled: now.saturating_duration_since(progressed) > STALLED_AFTER }
    }

    /// Handshake `id` progressed at `now` (its whole ClientHello arrived):
    /// it goes behind every one that has not progressed since.
    pub fn progressed(&mut self, id: u64, now: Instant) {
        let Some(entry) = self.entries.get_mut(&id) else { return };
        let (before, peer) = (entry.progressed, entry.peer);
        // A clock read before the accept's cannot move it back.
        let now = now.max(before);
        entry.progressed = now;
        self.by_progress.remove(&(before, id));
        self.by_progress.insert((now, id));
        if let Some(ids) = self.by_peer.get_mut(&peer) {
            ids.remove(&(before, id));
            ids.insert((now, id));
        }
    }

    /// Forgets handshake `id` (it ended, or was shed); whether it was in flight.
    pub fn remove(&mut self, id: u64) -> bool {
        let Some(Entry { peer, progressed }) = self.entries.remove(&id) else { return false };
        self.by_progress.remove(&(progressed, id));
        if let Some(ids) = self.by_peer.get_mut(&peer) {
            ids.remove(&(progressed, id));
            if ids.is_empty() {
                self.by_peer.remove(&peer);
            }
        }
        true
    }

    /// Handshakes in flight counted against `peer`'s cap.
    #[cfg(test)]
    fn of_peer(&self, peer: IpAddr) -> usize {
        self.by_peer.get(&PeerKey::of(peer)).map_or(0, BTreeSet::len)
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use super::*;

    const MS: Duration = Duration::from_millis(1);

    fn ip(text: &str) -> IpAddr {
        text.parse::<SocketAddr>().map(|a| a.ip()).or_else(|_| text.parse()).unwrap()
    }

    fn key(text: &str) -> PeerKey {
        PeerKey::of(ip(text))
    }

    fn ids(shed: &[Shedding]) -> Vec<(u64, Cap, bool)> {
        shed.iter().map(|s| (s.id, s.cap, s.stalled)).collect()
    }

    #[test]
    fn ipv6_peers_are_keyed_by_their_64_and_ipv4_peers_by_their_address() {
        // Real socket addresses, as the listener sees them.
        assert_eq!(key("[2001:db8:4e52:7::1]:50051"), key("[2001:db8:4e52:7:ffff:ffff:ffff:ffff]:1"));
        assert_ne!(key("[2001:db8:4e52:7::1]:50051"), key("[2001:db8:4e52:8::1]:50051"));
        assert_ne!(key("[2001:db8:4e52:7::1]:50051"), key("[2001:db9:4e52:7::1]:50051"));
        assert_eq!(key("[::1]:1"), PeerKey::V6Prefix(0));
        assert_ne!(key("10.0.0.1:1"), key("10.0.0.2:1"));
        assert_eq!(key("10.0.0.1:1"), key("10.0.0.1:2"));
        // A dual-stack listener sees IPv4 clients as mapped addresses.
        assert_eq!(key("[::ffff:10.0.0.1]:1"), key("10.0.0.1:9"));
        assert_ne!(key("[::ffff:10.0.0.1]:1"), key("[::ffff:10.0.0.2]:1"));
    }

    #[test]
    fn addresses_of_one_64_share_one_cap_and_shed_their_own() {
        let (t, mut handshakes) = (Instant::now(), Handshakes::new(Caps { total: 100, per_peer: 3 }));
        let (other, _) = handshakes.admit(ip("[2001:db8:4e52:8::1]:1"), t);
        let flood: Vec<u64> = (1..=3)
            .map(|n| handshakes.admit(ip(&format!("[2001:db8:4e52:7::{n}]:1")), t + n * MS).0)
            .collect();
        let (_, shed) = handshakes.admit(ip("[2001:db8:4e52:7::99]:1"), t + 10 * MS);
        assert_eq!(ids(&shed), vec![(flood[0], Cap::Peer, false)]);
        assert_eq!(handshakes.of_peer(ip("2001:db8:4e52:7::5")), 3);
        assert_eq!(handshakes.of_peer(ip("2001:db8:4e52:8::5")), 1);
        assert!(handshakes.entries.contains_key(&other));
    }

    #[test]
    fn a_whole_hello_stalled_past_a_second_is_shed_before_a_fresh_connect() {
        let (t, mut handshakes) = (Instant::now(), Handshakes::new(Caps { total: 2, per_peer: 2 }));
        // The flood's: accepted at t, its ClientHello at once, then nothing.
        let (stalled, _) = handshakes.admit(ip("10.0.0.66"), t);
        handshakes.progressed(stalled, t + MS);
        // A real client on a 50 ms path, accepted later; its ClientHello is on the way.
        let (real, _) = handshakes.admit(ip("10.0.0.1"), t + 1100 * MS);
        let (_, shed) = handshakes.admit(ip("10.0.0.67"), t + 1120 * MS);
        assert_eq!(ids(&shed), vec![(stalled, Cap::Listener, true)]);
        assert!(handshakes.entries.contains_key(&real));
    }

    #[test]
    fn the_longest_without_progress_goes_first_whatever_its_stage() {
        let (t, mut handshakes) = (Instant::now(), Handshakes::new(Caps { total: 4, per_peer: 4 }));
        let (silent, _) = handshakes.admit(ip("10.0.0.2"), t);
        let (hello, _) = handshakes.admit(ip("10.0.0.3"), t + MS);
        handshakes.progressed(hello, t + 2 * MS);
        let (real, _) = handshakes.admit(ip("10.0.0.1"), t + 3 * MS);
        let (late_silent, _) = handshakes.admit(ip("10.0.0.4"), t + 60 * MS);
        handshakes.progressed(real, t + 53 * MS);
        let order: Vec<u64> =
            (0..4u32).map(|n| handshakes.admit(ip("10.0.0.9"), t + (100 + n) * MS).1[0].id).collect();
        // The silent one (accepted at 0), the stalled hello (2 ms), the real
        // client whose hello came at 53 ms before the silent one accepted at 60 ms.
        assert_eq!(order, vec![silent, hello, real, late_silent]);
    }

    #[test]
    fn a_peer_past_its_cap_sheds_its_own_never_another_s() {
        let (t, mut handshakes) = (Instant::now(), Handshakes::new(Caps { total: 10, per_peer: 2 }));
        let (other, _) = handshakes.admit(ip("10.0.0.9"), t);
        let (first, _) = handshakes.admit(ip("10.0.0.1"), t + MS);
        let (second, _) = handshakes.admit(ip("10.0.0.1"), t + 2 * MS);
        handshakes.progressed(first, t + 3 * MS);
        // Its second is now the one longest without progress: shed, young.
        let (_, shed) = handshakes.admit(ip("10.0.0.1"), t + 4 * MS);
        assert_eq!(ids(&shed), vec![(second, Cap::Peer, false)]);
        assert!(handshakes.entries.contains_key(&other) && handshakes.entries.contains_key(&first));
        assert_eq!(handshakes.len(), 3);
    }

    #[test]
    fn a_connect_that_sheds_one_of_its_peer_s_makes_room_on_the_listener_too() {
        let (t, mut handshakes) = (Instant::now(), Handshakes::new(Caps { total: 3, per_peer: 2 }));
        let (other, _) = handshakes.admit(ip("10.0.0.9"), t);
        let (own, _) = handshakes.admit(ip("10.0.0.1"), t + MS);
        let (own_second, _) = handshakes.admit(ip("10.0.0.1"), t + 2 * MS);
        handshakes.progressed(own, t + 3 * MS);
        let (_, shed) = handshakes.admit(ip("10.0.0.1"), t + 2 * STALLED_AFTER);
        assert_eq!(ids(&shed), vec![(own_second, Cap::Peer, true)]);
        assert!(handshakes.entries.contains_key(&other), "the listener's cap had room again");
        assert_eq!(handshakes.len(), 3);
    }

    #[test]
    fn an_ended_handshake_is_forgotten_and_never_shed() {
        let (t, mut handshakes) = (Instant::now(), Handshakes::new(Caps { total: 2, per_peer: 2 }));
        let (first, _) = handshakes.admit(ip("10.0.0.1"), t);
        let (second, _) = handshakes.admit(ip("10.0.0.1"), t + MS);
        assert!(handshakes.remove(first));
        assert!(!handshakes.remove(first));
        handshakes.progressed(first, t + 2 * MS);
        let (_, shed) = handshakes.admit(ip("10.0.0.2"), t + 3 * MS);
        assert!(shed.is_empty(), "{shed:?}");
        assert_eq!(handshakes.of_peer(ip("10.0.0.1")), 1);
        let (_, shed) = handshakes.admit(ip("10.0.0.3"), t + 4 * MS);
        assert_eq!(ids(&shed), vec![(second, Cap::Listener, false)]);
        assert!(!handshakes.by_peer.contains_key(&key("10.0.0.1")), "an empty peer is dropped");
    }
}
