//! Writing to shared output streams once (`emit.lua`), settling a poison event's decision
//! (`void.lua`), recording the inbound fail policy's decisions (`record.lua`), deleting
//! departed consumers (`reap.lua`) and sizing pending entries before they are taken again
//! (`sizes.lua`).

use super::{push_fields, KeyIndex, Reply, Scripts, Writing};
use crate::error::Result;
use crate::event::Fields;
use crate::keys::{OutputKeys, RouteKeys};
use redis::aio::ConnectionLike;
use redis::Value;

/// Where an `emit` call writes.
pub struct EmitCall<'a> {
    pub keys: &'a OutputKeys,
    /// The write-once records' lifetime, the trim, the group and the acknowledgements.
    pub out: Writing<'a>,
}

/// One entry written once to a shared output stream by `emit`.
pub struct EmitItem<'a> {
    pub source_stream: &'a str,
    pub source_id: &'a str,
    pub fields: &'a Fields,
}

impl Scripts {
    /// Writes each item to the output stream unless an earlier delivery did, and acknowledges
    /// the ones it may; returns which were written now (see `lua/emit.lua`).
    pub async fn emit<C: ConnectionLike>(
        &self,
        con: &mut C,
        call: &EmitCall<'_>,
        items: &[EmitItem<'_>],
    ) -> Result<Vec<bool>> {
        let (mut hashes, mut streams) = (KeyIndex::default(), KeyIndex::default());
        let at: Vec<(usize, usize)> = items
            .iter()
            .map(|i| {
                let hash = hashes.index(call.keys.written(i.source_stream, i.source_id));
                (hash, call.out.ack_index(&mut streams, i.source_stream))
            })
            .collect();
        let mut inv = self.emit.prepare_invoke();
        inv.key(&call.keys.stream);
        for key in hashes.keys().iter().chain(streams.keys()) {
            inv.key(key);
        }
        call.out.push_args(&mut inv);
        inv.arg(hashes.len()).arg(streams.len()).arg(items.len());
        for (item, (hash, stream)) in items.iter().zip(at) {
            inv.arg(hash).arg(stream).arg(item.source_id);
            push_fields(&mut inv, item.fields);
        }
        let reply: Value = inv.invoke_async(con).await?;
        let mut values = Reply::new("emit", reply)?;
        items.iter().map(|_| Ok(values.int()? == 1)).collect()
    }
}

/// What `void` found on record before it voided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Voided {
    /// The decision before ("" if none).
    pub decision: String,
    /// Who owned the event's id on the route ("" if no one, or the event carries no id).
    pub owner: String,
    /// The route's decision hash held another kind of value (overwritten by hand): no decision
    /// was there to void.
    pub overwritten: bool,
}

impl Scripts {
    /// Voids a poison event's undispatched decision on one route (its entry `entry_id` of
    /// `stream`; `event_id` if it carries one); see `lua/void.lua`.
    pub async fn void<C: ConnectionLike>(
        &self,
        con: &mut C,
        keys: &RouteKeys,
        (stream, entry_id): (&str, &str),
        event_id: Option<&str>,
        ttl_ms: u64,
    ) -> Result<Voided> {
        let mut inv = self.void.prepare_invoke();
        inv.key(keys.decisions(stream, entry_id));
        if let Some(id) = event_id {
            inv.key(keys.claim(id));
        }
        inv.arg(entry_id).arg(ttl_ms);
        let (decision, owner, overwritten): (String, String, i64) = inv.invoke_async(con).await?;
        Ok(Voided {
            decision,
            owner,
            overwritten: overwritten == 1,
        })
    }

    /// Records `decision` for each inbound entry of `targets` (its decision hash and owner)
    /// that has none yet; returns the decision that stands for each (see `lua/record.lua`).
    pub async fn record<C: ConnectionLike>(
        &self,
        con: &mut C,
        targets: &[(String, String)],
        decision: &str,
        ttl_ms: u64,
    ) -> Result<Vec<String>> {
        let mut call = self.record.prepare_invoke();
        call.arg(ttl_ms).arg(decision);
        for (hash, owner) in targets {
            call.key(hash).arg(owner);
        }
        Ok(call.invoke_async(con).await?)
    }

    /// Deletes the group's consumers that hold nothing and have been idle `min_idle` or more,
    /// except `me`; returns how many (see `lua/reap.lua`).
    pub async fn reap<C: ConnectionLike>(
        &self,
        con: &mut C,
        stream: &str,
        group: &str,
        min_idle: std::time::Duration,
        me: &str,
    ) -> Result<i64> {
        let mut call = self.reap.prepare_invoke();
        call.key(stream)
            .arg(group)
            .arg(min_idle.as_millis() as u64)
            .arg(me);
        Ok(call.invoke_async(con).await?)
    }

    /// How many of entries `ids` of `stream`, from the first, fit in `budget` bytes of fields
    /// together (at least one; see `lua/sizes.lua`).
    pub async fn fitting<C: ConnectionLike>(
        &self,
        con: &mut C,
        stream: &str,
        ids: &[&str],
        budget: usize,
    ) -> Result<usize> {
        let mut call = self.sizes.prepare_invoke();
        call.key(stream).arg(budget).arg("ids");
        for id in ids {
            call.arg(*id);
        }
        let n: i64 = call.invoke_async(con).await?;
        Ok((n.max(0) as usize).min(ids.len()))
    }

    /// How many of the entries `group` would deliver next on `stream`, at most `most`, fit in
    /// `budget` bytes of fields together (at least one; `most` when fewer are there to deliver;
    /// see `lua/sizes.lua`).
    pub async fn fitting_next<C: ConnectionLike>(
        &self,
        con: &mut C,
        stream: &str,
        group: &str,
        most: usize,
        budget: usize,
    ) -> Result<usize> {
        let mut call = self.sizes.prepare_invoke();
        call.key(stream).arg(budget).arg("new").arg(group).arg(most);
        let n: i64 = call.invoke_async(con).await?;
        Ok((n.max(1) as usize).min(most.max(1)))
    }
}
