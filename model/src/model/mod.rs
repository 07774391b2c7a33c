//! The system around the store: brokers with their waiters and ledgers, the clients they
//! answer, the notices between them (delayed, duplicated or lost), brokers that die, time, and
//! store losses. The store's steps are `crate::store`'s; what the brokers do with the answers
//! follows `core/src/lock/` (waiters, acquire, release) and `redis-store/src/` (epoch, put-back,
//! ledger).

mod actions;
mod batch;
mod broker;
mod handed;
mod props;
mod session;
mod several;

pub use batch::Pend;
pub use session::{Acq, End, Life, Sess, SessAction, SessionCfg};
pub use several::{SevAction, Several, SeveralCfg, Step, Took};

use crate::store::{Bug, Fence, Key, Kind, Notice, Params, Store, Token};

/// The bounds of one exhaustive check.
#[derive(Clone, Debug)]
pub struct Config {
    pub name: &'static str,
    pub brokers: u8,
    /// Each client's broker, key and kind (a semaphore key takes only `Permit`s of one limit).
    pub clients: Vec<(u8, Key, Kind)>,
    pub keys: u8,
    /// Ticks (a tick stands for about a second): a lease's TTL, the offer window, the settle
    /// hold, PUT_BACK's hold, a waiter's fallback poll.
    pub ttl: u8,
    pub window: u8,
    pub settle: u8,
    pub put_back_hold: u8,
    pub poll: u8,
    /// Acquires of each client (one token each), renewals per lease.
    pub attempts: Vec<u8>,
    pub renews: u8,
    /// How many brokers may die, store losses, force releases, clock steps back, slack expiries.
    pub deaths: u8,
    pub losses: u8,
    pub forces: u8,
    pub clock_backs: u8,
    pub slacks: u8,
    /// A client under a session, or none.
    pub session: Option<SessionCfg>,
    /// Clients that acquire two keys at once (one acquire each).
    pub several: Vec<SeveralCfg>,
    /// Whether brokers batch claims and releases (group commit, BATCH).
    pub batch: bool,
    pub bug: Option<Bug>,
}

impl Config {
    pub fn params(&self) -> Params {
        Params {
            window: self.window,
            settle: self.settle,
            put_back_hold: self.put_back_hold,
            bug: self.bug,
        }
    }

    /// The bounded-progress bound (ticks): how long a key with a live broker's waiter may go
    /// without a grant — a holder's TTL and renewals, an offer to a dead broker lapsing, an
    /// offer whose notice was lost lapsing, a fallback poll, and a store loss's holds.
    pub fn max_stall(&self) -> u8 {
        self.ttl * (1 + self.renews)
            + 2 * self.window
            + self.poll
            + self.losses * (self.settle + self.put_back_hold)
            + self.session.map_or(0, |c| c.ttl * (1 + c.keeps) + c.delay)
            + self.several_hold()
    }

    /// How long several-keys requests may hold a key back beyond a single holder: each may
    /// hold it while it waits for its next key (bounded by that key's progress) and then with
    /// the other once granted (a TTL).
    fn several_hold(&self) -> u8 {
        let single = self.ttl * (1 + self.renews) + 2 * self.window + self.poll;
        self.several.len() as u8 * (single + self.ttl)
    }
}

/// Where a client is.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    Idle,
    /// Its acquire waits: its bid is queued (or about to ask again). `timer`: ticks until its
    /// broker's timer asks again; `due`: it asks before time passes (an offer, a requeue).
    Waiting {
        token: Token,
        timer: u8,
        due: bool,
    },
    /// A SETNX refused on an expired lease with this fence: it may take it over.
    Seen {
        token: Token,
        fence: Fence,
    },
    /// It holds a lease: until `left` ticks pass, unless `ended` (force-released, or lost with
    /// every broker that remembered it — the documented limit of put-back).
    Holding {
        token: Token,
        fence: Fence,
        left: u8,
        renewed: u8,
        ended: bool,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    pub phase: Phase,
    pub attempt: u8,
    /// Its operation that BATCH answered SLOW, to run alone.
    pub slow: Option<Pend>,
}

/// A ledger entry: a live lease this broker granted or renewed.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Entry {
    pub key: Key,
    pub token: Token,
    pub kind: Kind,
    pub fence: Fence,
    pub left: u8,
    pub session: bool,
}

/// Records a lease in a ledger (a grant or a renewal), replacing its token's entry.
pub(crate) fn remember(ledger: &mut Vec<Entry>, entry: Entry) {
    ledger.retain(|e| e.token != entry.token);
    ledger.push(entry);
    ledger.sort();
}

/// A lease a RELEASE of this broker granted straight to one of its own queued bids, not taken
/// by its waiter yet (the Redis store's map `(key, token) → lease`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Handed {
    pub key: Key,
    pub token: Token,
    pub fence: Fence,
    pub left: u8,
    /// Ghost: a force release ended the lease before its waiter took it.
    pub forced: bool,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BrokerState {
    pub alive: bool,
    pub known: Option<u8>,
    /// The epoch a CHECK found, to put the ledger back into.
    pub catching: Option<u8>,
    pub ledger: Vec<Entry>,
    /// Notices sent to it and not delivered yet (a set: a duplicate is a delivery that keeps it).
    pub inbox: Vec<Notice>,
    /// The operations gathered for its next BATCH call (client, operation), in arrival order.
    pub batch: Vec<(u8, Pend)>,
    /// The grants its RELEASEs handed to its own waiters, not taken yet.
    pub handed: Vec<Handed>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub store: Store,
    pub clients: Vec<Client>,
    pub brokers: Vec<BrokerState>,
    /// Used up of each bounded event: deaths, losses, forces, clock steps back, slack expiries.
    pub used: [u8; 5],
    /// Per key: the highest fence ever granted (ghost state for the fence property).
    pub top: Vec<Fence>,
    /// Per key: ticks since its last grant while a live broker's waiter waited for it (capped at
    /// `max_stall + 1`).
    pub stall: Vec<u8>,
    /// Per key: ticks in a row in which the key was held back only by an offer to a dead broker
    /// while a live broker's waiter waited for it.
    pub dead_block: Vec<u8>,
    pub fence_fault: bool,
    pub lost_offer: bool,
    /// The session client, if the configuration has one.
    pub sess: Option<Sess>,
    /// A close answered while a lease of its session that no acquire in flight releases was
    /// still held.
    pub close_fault: bool,
    /// The several-keys clients.
    pub several: Vec<Several>,
    /// Within one step only (empty between steps): handed leases a waiter took after a force
    /// release had ended them, its broker not knowing (by design, as a holder's lease forced).
    pub taken_forced: Vec<(Key, Fence)>,
}

/// The model: a configuration.
#[derive(Clone, Debug)]
pub struct LockModel {
    pub cfg: Config,
}

pub use actions::Action;

impl LockModel {
    pub fn init(&self) -> State {
        let c = &self.cfg;
        State {
            store: Store::new(c.keys as usize),
            clients: c
                .clients
                .iter()
                .map(|_| Client {
                    phase: Phase::Idle,
                    attempt: 0,
                    slow: None,
                })
                .collect(),
            brokers: (0..c.brokers)
                .map(|_| BrokerState {
                    alive: true,
                    known: Some(0),
                    catching: None,
                    ledger: Vec::new(),
                    inbox: Vec::new(),
                    batch: Vec::new(),
                    handed: Vec::new(),
                })
                .collect(),
            used: [0; 5],
            top: vec![0; c.keys as usize],
            stall: vec![0; c.keys as usize],
            dead_block: vec![0; c.keys as usize],
            fence_fault: false,
            lost_offer: false,
            sess: c.session.map(|_| Sess::new()),
            close_fault: false,
            several: c.several.iter().map(|_| Several::new()).collect(),
            taken_forced: Vec::new(),
        }
    }
}

/// Renumbers every fence in the state (order and equality kept) to multiples of `US_STEP`,
/// so that states that differ only in the fences' absolute values are one.
pub fn canonical(s: &mut State) {
    use crate::store::US_STEP;
    let mut all: Vec<Fence> = Vec::new();
    visit_fences(s, &mut |f| {
        if *f != 0 {
            all.push(*f)
        }
    });
    all.sort_unstable();
    all.dedup();
    visit_fences(s, &mut |f| {
        if *f != 0 {
            *f = (all.binary_search(f).expect("a fence seen") as Fence + 1) * US_STEP;
        }
    });
}

fn visit_fences(s: &mut State, f: &mut impl FnMut(&mut Fence)) {
    f(&mut s.store.us);
    for k in &mut s.store.keys {
        if let Some(c) = &mut k.counter {
            f(c);
        }
        if let Some(l) = &mut k.lock {
            f(&mut l.fence);
        }
        for l in &mut k.pool {
            f(&mut l.fence);
        }
    }
    for b in &mut s.brokers {
        for e in &mut b.ledger {
            f(&mut e.fence);
        }
        for h in &mut b.handed {
            f(&mut h.fence);
        }
        for n in &mut b.inbox {
            if let Notice::Ended(_, fence, _) = n {
                f(fence);
            }
        }
    }
    for c in &mut s.clients {
        match &mut c.phase {
            Phase::Seen { fence, .. } | Phase::Holding { fence, .. } => f(fence),
            _ => {}
        }
    }
    if let Some(ss) = &mut s.sess {
        match &mut ss.acq {
            Acq::Granted { fence, .. } | Acq::Holding { fence, .. } => f(fence),
            _ => {}
        }
    }
    for t in s.several.iter_mut().flat_map(|sv| sv.took.iter_mut()) {
        f(&mut t.fence);
    }
    for t in &mut s.top {
        f(t);
    }
}

/// The acquire is over (released, ended, refused, given up): the next one may start.
pub(super) fn finish(cl: &mut Client) {
    cl.phase = Phase::Idle;
    cl.attempt += 1;
}
