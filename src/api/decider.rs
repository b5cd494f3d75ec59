//! Deciding one synchronous request: its identities (the stream flow's own keys), the leases
//! that may answer it locally, and otherwise `decide.lua`, in a batch with whatever other
//! requests the worker has in hand (`batch`).

use super::batch::Batcher;
use super::lease::{Fetch, Leases, Slot, Take, Taken};
use crate::admission::{Algorithm, Ask, CheckOutcome, Room, SyncVerdict, SPACING};
use crate::config::{FailPolicy, InboundConfig, InboundRule, Lease, READ_TIMEOUT};
use crate::connection::RedisConn;
use crate::event::inbound::{resolve, Identity};
use crate::health::Health;
use crate::scripts::spacing_label;
use crate::telemetry;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Which face a request came through (the `api` label).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    Http,
    Grpc,
}

impl Api {
    pub fn as_str(self) -> &'static str {
        match self {
            Api::Http => "http",
            Api::Grpc => "grpc",
        }
    }
}

/// A synchronous request: the identity fields, what it counts for, and which rules apply.
#[derive(Debug, Clone, Default)]
pub struct Request {
    pub fields: Vec<(String, String)>,
    /// Events it counts for; 0 for a check that charges nothing (HTTP's `cost: 0`, an Envoy
    /// descriptor's own `hits_addend` of 0), decided in Redis at cost 0 (`lua/decide.lua`)
    /// with no lease spent or asked for: refused only where a count is already past its
    /// limit, as envoyproxy/ratelimit answers a hit of 0 (it adds 0 and refuses a count over
    /// the limit), which pacer, counting no refused request, reaches only under
    /// `count_rejected`. Its answer carries the limit with the least room, as any other's.
    pub cost: i64,
    /// Rule names; `None`: every rule (HTTP), or every rule whose key fields the request
    /// carries (Envoy's descriptors, see `envoy`).
    pub rules: Option<Vec<String>>,
    /// Apply only the rules whose key fields are all given (Envoy's mapping).
    pub only_matching: bool,
}

/// The limit an answer reports: the binding one when refused, else the one with least room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reported {
    pub rule: String,
    /// As configured (`10/s`), or `min_spacing 1s`.
    pub label: String,
    /// The limit's count and window (for `min_spacing`: 1 per spacing).
    pub count: i64,
    pub window_us: i64,
    /// The key field whose identity it is.
    pub field: String,
    pub remaining: i64,
    /// µs until the room is whole again (refused: until it would pass).
    pub reset_us: i64,
}

/// The decision about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    pub allowed: bool,
    /// µs until a retry could pass (0 when allowed).
    pub retry_us: i64,
    /// `None` when no rule applied (or only a rule of no limit).
    pub limit: Option<Reported>,
    /// Decided by Redis (false: from this worker's leases).
    pub via_redis: bool,
    /// Allowed unchecked because Redis could not be reached and `fail_policy` is fail_open.
    pub unchecked: bool,
}

/// Why a request could not be decided.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    /// The request itself is wrong (HTTP 400).
    #[error("{0}")]
    Bad(String),
    /// Redis could not be reached and `fail_policy` is fail_closed (HTTP 503).
    #[error("limiter unavailable: {0}")]
    Unavailable(String),
}

/// The most one request may cost: HTTP's `cost`, gRPC's `hits_addend`. Above it a cost is
/// refused rather than clamped or wrapped, as a hostile one must not be charged as something
/// else.
pub const MAX_COST: i64 = 1_000_000_000;

/// The largest request read, an HTTP body or a gRPC message: far above what names a few
/// identities, far below what would keep a worker busy.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// Most requests one call may ask for at once (Envoy's descriptors): Envoy sends one per rate
/// limit action of the route, a handful; 100,000 kept a worker busy 2.4 s.
pub const MAX_REQUESTS: usize = 1024;

/// Most requests `decide_all` decides at once.
const TOGETHER: usize = 64;

/// Adds the rules `ids` are checked against to `rules`, each once.
fn rules_of(ids: &[Identity], rules: &mut Vec<usize>) {
    for id in ids {
        if !rules.contains(&id.rule) {
            rules.push(id.rule);
        }
    }
}

/// Decides synchronous requests on the inbound rules; shared by the HTTP and gRPC faces.
pub struct Decider {
    cfg: InboundConfig,
    batcher: Batcher,
    leases: Leases,
    metrics: telemetry::ApiMetrics,
}

impl Decider {
    /// A decider on `cfg`'s rules, whose Redis calls tell `health` how Redis is doing (an
    /// idle stream flow would not see a Redis that refuses the API's writes).
    /// A request waits for its Redis call at most about `timeout` (`redis.timeout`) past the
    /// call's own.
    pub fn new(
        cfg: InboundConfig,
        con: RedisConn,
        timeout: Duration,
        health: Arc<Health>,
    ) -> Arc<Self> {
        Arc::new(Decider {
            batcher: Batcher::start(cfg.rules.clone(), con, timeout, health),
            metrics: telemetry::ApiMetrics::new(&cfg),
            cfg,
            leases: Leases::default(),
        })
    }

    pub fn config(&self) -> &InboundConfig {
        &self.cfg
    }

    /// How long a client has to send a request (`inbound.api.read_timeout`).
    pub fn read_timeout(&self) -> Duration {
        self.cfg
            .api
            .as_ref()
            .map_or(READ_TIMEOUT, |a| a.read_timeout)
    }

    /// The request's identities, or why it cannot be decided.
    fn identities(&self, req: &Request) -> Result<(usize, Vec<Identity>), Refusal> {
        if !(0..=MAX_COST).contains(&req.cost) {
            return Err(Refusal::Bad(format!(
                "cost must be a whole number from 0 to {MAX_COST}, got {}",
                req.cost
            )));
        }
        let rules = &self.cfg.rules;
        if let Some(names) = &req.rules {
            for name in names {
                if !rules.iter().any(|r| &r.name == name) {
                    return Err(Refusal::Bad(format!("no rule named {name:?}")));
                }
            }
        }
        let given = |field: &str| req.fields.iter().any(|(k, v)| k == field && !v.is_empty());
        // A rule named is applied whatever fields were given, so that one it lacks is said
        // (a gRPC `pacer_rule` whose key entry was misspelt used to pass with no limit).
        let applies = |r: usize| {
            let rule = &rules[r];
            match &req.rules {
                Some(names) => names.contains(&rule.name),
                None => {
                    !req.only_matching
                        || rule.default_identity.is_some()
                        || rule.key.iter().all(|f| given(f))
                }
            }
        };
        let value = |field: &str| {
            let mut values = req.fields.iter().filter(|(k, _)| k == field);
            let v = values.next().map(|(_, v)| v.as_bytes());
            if values.next().is_some() {
                return Err(crate::event::Refused::malformed(format!(
                    "the field {field} is given twice"
                )));
            }
            Ok(v)
        };
        let (partition, ids) =
            resolve(&self.cfg, applies, value).map_err(|r| Refusal::Bad(r.detail))?;
        // A cost above what a limit can ever pass would be refused forever: say so now.
        for id in &ids {
            let rule = &rules[id.rule];
            for l in &rule.rule.limits {
                let most = match rule.rule.algorithm {
                    Algorithm::Gcra => l.tolerance_us / l.interval_us + 1,
                    _ => l.count,
                };
                if req.cost > most && !rule.shadow {
                    return Err(Refusal::Bad(format!(
                        "cost {} is more than rule {}'s limit {} ever passes at once ({most})",
                        req.cost, rule.name, l.label
                    )));
                }
            }
        }
        Ok((partition, ids))
    }

    /// Decides `req`: from this worker's leases when every identity it is checked as is leased
    /// and holds tokens, else through Redis, in a batch with the other requests in hand (the
    /// call refills the leases it needs).
    pub async fn decide(&self, api: Api, req: &Request) -> Result<Answer, Refusal> {
        let started = Instant::now();
        let (partition, ids) = self.identities(req)?;
        let mut checked = Vec::new();
        rules_of(&ids, &mut checked);
        let answer = self.decide_resolved(api, req, partition, ids).await;
        self.metrics.record(api, &checked, started);
        answer
    }

    /// Decides several requests at once (Envoy's descriptors), each on its own: none is decided
    /// unless every one can be (the first that cannot is returned, with its index), and those
    /// that reach Redis are in hand together, so they go in one batch rather than one round
    /// trip each. Requests on one identity are decided in their order (the batch keeps it, a
    /// lease's fetch lock queues them).
    pub async fn decide_all(
        &self,
        api: Api,
        reqs: &[Request],
    ) -> Result<Vec<Answer>, (usize, Refusal)> {
        let started = Instant::now();
        let resolved = reqs
            .iter()
            .enumerate()
            .map(|(i, r)| self.identities(r).map_err(|e| (i, e)))
            .collect::<Result<Vec<_>, _>>()?;
        let mut checked = Vec::new();
        for (_, ids) in &resolved {
            rules_of(ids, &mut checked);
        }
        // In rounds of at most TOGETHER: one task polling more futures than tokio's cooperative
        // budget (128 operations a poll) has every lock past the budget answer "not yet" and
        // wake it again: 100,000 descriptors at once took 21 s, in rounds of 64 2.4 s.
        let mut answers = Vec::with_capacity(reqs.len());
        let mut todo = reqs.iter().zip(resolved).enumerate().peekable();
        while todo.peek().is_some() {
            let round = todo
                .by_ref()
                .take(TOGETHER)
                .map(|(i, (r, (partition, ids)))| async move {
                    let answer = self.decide_resolved(api, r, partition, ids).await;
                    answer.map_err(|e| (i, e))
                });
            for answer in futures_util::future::join_all(round).await {
                answers.push(answer?);
            }
        }
        self.metrics.record(api, &checked, started);
        Ok(answers)
    }

    async fn decide_resolved(
        &self,
        api: Api,
        req: &Request,
        partition: usize,
        ids: Vec<Identity>,
    ) -> Result<Answer, Refusal> {
        if req.cost == 0 {
            return self.check_only(api, partition, ids).await;
        }
        let rules = &self.cfg.rules;
        let mut asks = vec![Ask::Decide; ids.len()];
        let leased: Vec<Option<&crate::config::Lease>> =
            ids.iter().map(|id| rules[id.rule].lease.as_ref()).collect();
        let slots: Vec<_> = ids
            .iter()
            .zip(&leased)
            .map(|(id, l)| l.map(|_| self.leases.slot(&id.key, Instant::now())))
            .collect();
        // Spend leased tokens; the identities whose leases are empty take their fetch locks
        // (single flight, in key order so that two requests never wait on each other), look
        // again (whoever held a lock may have just refilled that lease), and fetch.
        let mut held = Vec::new();
        // Where each identity's leased tokens came from, to give them back if refused after all.
        let mut taken = vec![Taken::default(); ids.len()];
        for phase in 0..2 {
            let now = Instant::now();
            let mut missing = Vec::new();
            for (x, slot) in slots.iter().enumerate() {
                let Some(slot) = slot else { continue };
                if asks[x] == Ask::Covered || (phase == 1 && !held.iter().any(|(h, _)| *h == x)) {
                    continue;
                }
                match slot.take(req.cost, now) {
                    (Take::Spent(_), from) => {
                        asks[x] = Ask::Covered;
                        taken[x] = from;
                    }
                    (Take::Blocked(wait), _) => {
                        self.give_back(&slots, &mut taken, now);
                        return Ok(self.refused_locally(api, &ids, x, wait));
                    }
                    (Take::Empty, _) => missing.push(x),
                }
            }
            if asks.iter().all(|a| *a == Ask::Covered) {
                self.fetch_ahead(api, partition, &ids, &slots, now);
                return Ok(self.allowed_locally(api, &ids, &slots, now));
            }
            if phase == 1 || missing.is_empty() {
                break;
            }
            missing.sort_by(|a, b| ids[*a].key.cmp(&ids[*b].key));
            let waiting = Instant::now();
            for x in missing {
                let slot = slots[x].as_ref().expect("leased");
                held.push((x, slot.fetch.lock().await));
                // The fetch this request waited behind failed: Redis did not answer it, and
                // would not answer this one sooner.
                if let Some(e) = slot.failed_since(waiting) {
                    drop(held);
                    self.give_back(&slots, &mut taken, Instant::now());
                    return self.unavailable(api, &ids, e.to_string());
                }
            }
        }
        let sent = Instant::now();
        for (x, _) in &held {
            let x = *x;
            if asks[x] != Ask::Covered {
                let slot = slots[x].as_ref().expect("leased");
                // What the lease still holds pays for part of the request (given back if it is
                // refused); Redis decides the rest. Taken first, so that a lease so spent
                // counts as used up when the next one is sized.
                let (paid, from, paid_until_us) = slot.take_part(req.cost - 1, sent);
                taken[x] = from;
                let more = slot.next_size(leased[x].expect("leased"), sent);
                asks[x] = Ask::Lease {
                    more,
                    paid,
                    paid_until_us,
                };
            }
        }
        let checks = ids
            .iter()
            .zip(&asks)
            .map(|(id, ask)| (id.rule, id.field, id.key.clone(), *ask))
            .collect();
        let reply = self.batcher.decide(partition, checks, req.cost).await;
        telemetry::api_redis_call(api);
        let verdict = match reply {
            Ok(v) => v,
            Err(e) => {
                let now = Instant::now();
                for (x, _) in &held {
                    slots[*x].as_ref().expect("leased").fetch_failed(now, &e);
                }
                drop(held);
                self.give_back(&slots, &mut taken, now);
                return self.unavailable(api, &ids, e);
            }
        };
        // Store what was leased; keep a refusal on a leased identity until its retry time.
        for (x, outcome) in verdict.checks.iter().enumerate() {
            let (
                Some(slot),
                ask @ Ask::Lease {
                    more: asked, paid, ..
                },
            ) = (&slots[x], asks[x])
            else {
                continue;
            };
            let lease = leased[x].expect("leased");
            let rule = &rules[ids[x].rule].name;
            if verdict.accepted {
                let charged = ask.units(req.cost, verdict.now_us);
                let r = slot.refill(
                    fetched(asked, charged, (lease, &verdict, outcome)),
                    sent,
                    sent + span(lease, outcome),
                    turn(outcome),
                    lease,
                );
                // Tokens taken from leases that had ended when Redis decided: not counted as
                // paid there, so wasted.
                let unpaid = if charged == req.cost { paid } else { 0 };
                telemetry::lease_fetched(rule, false, outcome.granted, r.wasted + unpaid);
            } else if verdict.binding.is_some_and(|(b, _)| b == x) {
                let retry = Duration::from_micros(verdict.retry_us.max(0) as u64);
                slot.refused((asked, req.cost), sent, retry, turn(outcome), lease);
            }
        }
        if !verdict.accepted {
            self.give_back(&slots, &mut taken, Instant::now());
        }
        drop(held);
        Ok(self.answer(api, &ids, &slots, &verdict, false))
    }

    /// Decides a check that charges nothing (a `Request` of cost 0) in Redis, at cost 0 and
    /// with no lease taken or asked for: the room it reports is the identities' in Redis,
    /// where the tokens leased out are charged, and what this worker's leases of them hold,
    /// as every answer reports it (`answer`). Before, a check asked of a worker holding a
    /// lease of 4 said 4 less than a request answered from that lease said next.
    async fn check_only(
        &self,
        api: Api,
        partition: usize,
        ids: Vec<Identity>,
    ) -> Result<Answer, Refusal> {
        let checks = ids
            .iter()
            .map(|id| (id.rule, id.field, id.key.clone(), Ask::Decide))
            .collect();
        let reply = self.batcher.decide(partition, checks, 0).await;
        telemetry::api_redis_call(api);
        let rules = &self.cfg.rules;
        let slots: Vec<_> = ids
            .iter()
            .map(|id| {
                rules[id.rule]
                    .lease
                    .as_ref()
                    .and_then(|_| self.leases.peek(&id.key))
            })
            .collect();
        match reply {
            Ok(v) => Ok(self.answer(api, &ids, &slots, &v, true)),
            Err(e) => self.unavailable(api, &ids, e),
        }
    }

    /// The answer when Redis could not decide (`error`): `fail_policy`'s.
    fn unavailable(&self, api: Api, ids: &[Identity], error: String) -> Result<Answer, Refusal> {
        let mut rules: Vec<usize> = ids.iter().map(|id| id.rule).collect();
        rules.sort_unstable();
        rules.dedup();
        for rule in rules {
            self.metrics.unanswered(api, rule);
        }
        match self.cfg.fail_policy {
            FailPolicy::FailOpen => Ok(Answer {
                allowed: true,
                retry_us: 0,
                limit: None,
                via_redis: false,
                unchecked: true,
            }),
            FailPolicy::FailClosed => Err(Refusal::Unavailable(error)),
        }
    }

    /// Fetches ahead, in the background, the leases a request left low (`Slot::fetch_ahead`):
    /// a steady identity's requests then find tokens, rather than one in every batch waiting
    /// on Redis (which set the p99 latency with leasing).
    fn fetch_ahead(
        &self,
        api: Api,
        partition: usize,
        ids: &[Identity],
        slots: &[Option<Arc<Slot>>],
        now: Instant,
    ) {
        for (id, slot) in ids.iter().zip(slots) {
            let Some(slot) = slot.as_ref().filter(|s| s.fetch_ahead(now)) else {
                continue;
            };
            let rule = &self.cfg.rules[id.rule];
            let ahead = Ahead {
                api,
                batcher: self.batcher.clone(),
                slot: slot.clone(),
                lease: rule.lease.clone().expect("leased"),
                rule: rule.name.clone(),
                partition,
                check: (id.rule, id.field, id.key.clone()),
            };
            tokio::spawn(ahead.fetch());
        }
    }

    /// Returns the tokens a request took from its leases, when it is refused after all.
    fn give_back(&self, slots: &[Option<Arc<Slot>>], taken: &mut [Taken], now: Instant) {
        for (slot, taken) in slots.iter().zip(taken) {
            if let Some(slot) = slot {
                slot.give_back(std::mem::take(taken), now);
            }
        }
    }

    fn reported(&self, id: &Identity, limit: usize, remaining: i64, reset_us: i64) -> Reported {
        let rule = &self.cfg.rules[id.rule];
        let (label, count, window_us) = if limit == SPACING || limit >= rule.rule.limits.len() {
            let s = rule.rule.spacing_us;
            (spacing_label(s), 1, s)
        } else {
            let l = &rule.rule.limits[limit];
            (l.label.clone(), l.count, l.window_us)
        };
        Reported {
            rule: rule.name.clone(),
            label,
            count,
            window_us,
            field: rule.key[id.field].clone(),
            remaining,
            reset_us,
        }
    }

    /// The answer from a Redis verdict, counted (as `checked` when the request charged nothing,
    /// `check_only`).
    fn answer(
        &self,
        api: Api,
        ids: &[Identity],
        slots: &[Option<Arc<Slot>>],
        v: &SyncVerdict,
        check_only: bool,
    ) -> Answer {
        let now = Instant::now();
        let limit = match v.binding {
            Some((x, lim)) => Some(self.reported(&ids[x], lim, 0, v.retry_us)),
            None => ids
                .iter()
                .zip(&v.checks)
                .zip(slots)
                .filter(|((id, _), _)| !self.cfg.rules[id.rule].shadow)
                .filter_map(|((id, c), slot)| match c.room {
                    // The room Redis has left, and what this worker's lease of the identity
                    // holds now (what Redis just granted it, stored before this answer, and a
                    // lease fetched ahead): the identity's room as later requests answered here
                    // report it (`Slot::room`). A check of cost 0 fetches nothing and reports
                    // the same.
                    Some(room) if room.remaining != i64::MAX => {
                        let mine = slot.as_ref().map_or(0, |s| s.left(now).0);
                        let remaining = room.remaining.saturating_add(mine);
                        Some((id, remaining, room.limit, room.reset_us))
                    }
                    Some(_) => None,
                    // Spent from its lease (not asked of Redis): its room as the worker knows
                    // it, so that a tighter leased identity is not left out of the answer.
                    None => slot
                        .as_ref()?
                        .room(now)
                        .map(|(remaining, lim, reset)| (id, remaining, lim, reset)),
                })
                .min_by_key(|(_, remaining, _, _)| *remaining)
                .map(|(id, remaining, lim, reset)| self.reported(id, lim, remaining, reset)),
        };
        for (id, c) in ids.iter().zip(&v.checks) {
            if check_only {
                self.metrics.checked(api, id.rule);
            } else {
                self.metrics.decided(api, id.rule, c.passed);
            }
        }
        Answer {
            allowed: v.accepted,
            retry_us: v.retry_us,
            limit,
            via_redis: true,
            unchecked: false,
        }
    }

    /// Every identity spent a leased token: allowed here. The room reported is the identity's
    /// as this worker last knew it (`Slot::room`), or, before any fetch said, what its leases
    /// hold until they end.
    fn allowed_locally(
        &self,
        api: Api,
        ids: &[Identity],
        slots: &[Option<Arc<Slot>>],
        now: Instant,
    ) -> Answer {
        let mut limit: Option<Reported> = None;
        for (id, slot) in ids.iter().zip(slots) {
            let rule = &self.cfg.rules[id.rule];
            self.metrics.decided(api, id.rule, true);
            let slot = slot.as_ref().expect("leased");
            let (left, lim, reset_us) = slot.room(now).unwrap_or_else(|| {
                let (left, ends) = slot.left(now);
                (left, tightest(rule), ends.as_micros() as i64)
            });
            if limit.as_ref().is_none_or(|l| left < l.remaining) {
                limit = Some(self.reported(id, lim, left, reset_us));
            }
        }
        Answer {
            allowed: true,
            retry_us: 0,
            limit,
            via_redis: false,
            unchecked: false,
        }
    }

    /// Refused here: Redis refused this leased identity moments ago, until `wait` from now.
    fn refused_locally(&self, api: Api, ids: &[Identity], x: usize, wait: Duration) -> Answer {
        let retry_us = wait.as_micros().max(1) as i64;
        let rule = &self.cfg.rules[ids[x].rule];
        for id in ids {
            self.metrics.decided(api, id.rule, id.rule != ids[x].rule);
        }
        Answer {
            allowed: false,
            retry_us,
            limit: Some(self.reported(&ids[x], tightest(rule), 0, retry_us)),
            via_redis: false,
            unchecked: false,
        }
    }
}

/// The rule's limit of the smallest count (or its min_spacing): the one an answer names when
/// no Redis reply said which binds.
fn tightest(rule: &InboundRule) -> usize {
    (0..rule.rule.limits.len())
        .min_by_key(|&i| rule.rule.limits[i].count)
        .unwrap_or(SPACING)
}

/// A fetch ahead of need on one leased identity: a request of cost 1 on it alone, leasing
/// more with it; the request's own token goes into the lease too.
struct Ahead {
    api: Api,
    batcher: Batcher,
    slot: Arc<Slot>,
    lease: Lease,
    rule: String,
    partition: usize,
    /// (rule index, key field index, limiter key).
    check: (usize, usize, String),
}

impl Ahead {
    async fn fetch(self) {
        // Single flight: a request that found the lease empty is fetching already.
        let Ok(_flight) = self.slot.fetch.try_lock() else {
            self.slot.ahead_dropped();
            return;
        };
        let sent = Instant::now();
        if !self.slot.ahead_wanted(sent) {
            self.slot.ahead_dropped();
            return;
        }
        let asked = self.slot.next_size(&self.lease, sent);
        let (rule, field, key) = self.check;
        let reply = self
            .batcher
            .decide(
                self.partition,
                vec![(
                    rule,
                    field,
                    key,
                    Ask::Lease {
                        more: asked,
                        paid: 0,
                        paid_until_us: 0,
                    },
                )],
                1,
            )
            .await;
        telemetry::api_redis_call(self.api);
        let Some((v, outcome)) = reply
            .ok()
            .and_then(|v| v.checks.first().cloned().map(|c| (v, c)))
        else {
            self.slot.ahead_dropped();
            return;
        };
        if v.accepted {
            let r = self.slot.ahead_fetched(
                fetched(asked, 1, (&self.lease, &v, &outcome)),
                sent,
                sent + span(&self.lease, &outcome),
                turn(&outcome),
                &self.lease,
            );
            telemetry::lease_fetched(&self.rule, true, outcome.granted + 1, r.wasted);
        } else {
            let retry = Duration::from_micros(v.retry_us.max(0) as u64);
            self.slot.ahead_refused(sent, retry, turn(&outcome));
        }
    }
}

/// What a fetch of `asked` tokens, with a request of `cost` (charged in Redis), got.
fn fetched(
    asked: i64,
    cost: i64,
    (lease, verdict, outcome): (&Lease, &SyncVerdict, &CheckOutcome),
) -> Fetch {
    Fetch {
        asked,
        granted: outcome.granted,
        cost,
        room: outcome.room.unwrap_or(Room::UNLIMITED),
        until_us: verdict.now_us + span(lease, outcome).as_micros() as i64,
    }
}

/// How long a lease Redis granted may be spent from when its call was sent: the ttl, or a
/// fixed window's time to its end if sooner.
fn span(lease: &Lease, outcome: &CheckOutcome) -> Duration {
    if outcome.lease_us > 0 {
        lease
            .ttl
            .min(Duration::from_micros(outcome.lease_us as u64))
    } else {
        lease.ttl
    }
}

/// The fetch turn Redis booked a leased check, as a wait from when the call was sent (the
/// reply's µs are from Redis's `now`, which the call saw after it was sent: the turn comes a
/// round trip early at most).
fn turn(outcome: &CheckOutcome) -> Option<Duration> {
    (outcome.turn_in_us > 0).then(|| Duration::from_micros(outcome.turn_in_us as u64))
}
