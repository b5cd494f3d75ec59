//! Many one-key commands in few round trips, whatever the deployment: `RedisConn::keyed`, with
//! which the monitor's gauges and `pacer inspect` read every route's bucket and every stream.
//!
//! redis-rs sends a cluster pipeline to the slot of its first key and refuses one whose keys
//! span slots, so these reads went slot by slot: the buckets of 5,000 routes took about 4,300
//! round trips per worker every 2 s on a cluster, against 10 on one server. A node serves any
//! key of its own slots in one pipeline, so here the commands are grouped by master, by the
//! slot map pacer reads for the turns (`super::turns`), and each group goes to its master.
//!
//! A map gone stale (a slot moved since it was read) sends a key to a master that answers
//! MOVED, and redis-rs then fails the whole round trip (it redirects a pipeline as one, to
//! where the other keys are not). So the commands of a round trip that failed, other than by
//! a timeout, are grouped again after the map is read anew; those of a round trip that fails
//! again (a slot still migrating) go slot by slot, where redis-rs follows MOVED and ASK, as
//! every command does when no map can be read.

use super::{Inner, RedisConn};
use futures_util::StreamExt;
use redis::aio::ConnectionLike;
use redis::{Cmd, RedisResult, Value};
use std::collections::BTreeMap;
use std::sync::Arc;

/// Most commands in one round trip.
const PER_ROUND_TRIP: usize = 512;
/// Round trips out at once.
const IN_FLIGHT: usize = 16;

/// A command's reply, and the reply to its round trip's `head`: the same node's (its `TIME`,
/// say). Nil when no head was given.
#[derive(Debug, Clone)]
pub struct Keyed {
    pub reply: RedisResult<Value>,
    pub head: RedisResult<Value>,
}

/// What one round trip may hold: any commands (one node), the slots of one master, or one slot.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Group {
    Any,
    Master(Arc<str>),
    Slot(u16),
}

/// How a pass groups the commands: by the map as it is, by the map read anew, or by slot.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    Map,
    MapReadAgain,
    Slot,
}

/// One round trip's commands (by their index), and its replies or why it failed as a whole.
struct Trip {
    group: Group,
    at: Vec<usize>,
    replies: RedisResult<Vec<Keyed>>,
}

impl RedisConn {
    /// The replies to `cmds` (each with the one key it touches), in order, a few hundred to a
    /// round trip and each round trip led by `head` when given. A command's own error is its
    /// reply, and so is its round trip's (a node that did not answer).
    pub async fn keyed(&self, cmds: &[(&str, Cmd)], head: Option<&Cmd>) -> Vec<Keyed> {
        let mut out: Vec<Option<Keyed>> = vec![None; cmds.len()];
        let mut todo: Vec<usize> = (0..cmds.len()).collect();
        for pass in [Pass::Map, Pass::MapReadAgain, Pass::Slot] {
            if todo.is_empty() {
                break;
            }
            // A connection made for one command (`pacer inspect`) has read no map yet: a call
            // with a key starts a read, in the background, and these have made none.
            let unread = matches!(&self.inner, Inner::Cluster(con) if !con.slots_read());
            if pass == Pass::MapReadAgain || (pass == Pass::Map && unread) {
                self.read_slots().await;
            }
            let group = |&i: &usize| self.group_of(cmds[i].0, pass);
            let lists = groups(std::mem::take(&mut todo), group, PER_ROUND_TRIP);
            for trip in self.round_trips(cmds, head, lists).await {
                let misrouted = match &trip.replies {
                    Err(e) => !e.is_timeout(),
                    Ok(replies) => replies.iter().any(
                        |k| matches!(&k.reply, Err(e) if matches!(e.code(), Some("MOVED" | "ASK"))),
                    ),
                };
                if misrouted && matches!(trip.group, Group::Master(_)) && pass != Pass::Slot {
                    todo.extend(trip.at);
                    continue;
                }
                match trip.replies {
                    Ok(replies) => {
                        for (i, keyed) in trip.at.into_iter().zip(replies) {
                            out[i] = Some(keyed);
                        }
                    }
                    Err(e) => {
                        for i in trip.at {
                            let (reply, head) = (Err(e.clone()), Err(e.clone()));
                            out[i] = Some(Keyed { reply, head });
                        }
                    }
                }
            }
        }
        out.into_iter()
            .map(|k| k.expect("a reply to every command"))
            .collect()
    }

    fn group_of(&self, key: &str, pass: Pass) -> Group {
        match &self.inner {
            Inner::Cluster(con) => {
                let slot = super::key_slot(key);
                let master = (pass != Pass::Slot).then(|| con.master_of(slot)).flatten();
                master.map_or(Group::Slot(slot), Group::Master)
            }
            Inner::Standalone(_) | Inner::Sentinel(_) => Group::Any,
        }
    }

    /// The round trips of `lists`, `IN_FLIGHT` out at once.
    async fn round_trips(
        &self,
        cmds: &[(&str, Cmd)],
        head: Option<&Cmd>,
        lists: Vec<(Group, Vec<usize>)>,
    ) -> Vec<Trip> {
        futures_util::stream::iter(lists)
            .map(|(group, at)| self.clone().round_trip(cmds, head, group, at))
            .buffer_unordered(IN_FLIGHT)
            .collect()
            .await
    }

    async fn round_trip(
        mut self,
        cmds: &[(&str, Cmd)],
        head: Option<&Cmd>,
        group: Group,
        at: Vec<usize>,
    ) -> Trip {
        let mut pipe = redis::pipe();
        if let Some(head) = head {
            pipe.add_command(head.clone());
        }
        for &i in &at {
            pipe.add_command(cmds[i].1.clone());
        }
        let count = at.len() + usize::from(head.is_some());
        let replies = match (&group, &mut self.inner) {
            (Group::Master(_), Inner::Cluster(con)) => {
                con.pipeline_to_master_of(cmds[at[0]].0, pipe, count).await
            }
            _ => self.req_packed_commands(&pipe, 0, count).await,
        };
        let replies = replies.and_then(|values| {
            if values.len() != count {
                return Err(redis::RedisError::from((
                    redis::ErrorKind::UnexpectedReturnType,
                    "a pipeline answered with another number of replies than commands",
                )));
            }
            let mut values = values.into_iter().map(Value::extract_error);
            let head = match head {
                Some(_) => values.next().expect("counted"),
                None => Ok(Value::Nil),
            };
            let keyed = values.map(|reply| {
                let head = head.clone();
                Keyed { reply, head }
            });
            Ok(keyed.collect())
        });
        Trip { group, at, replies }
    }
}

/// `items` in lists of at most `per` of one group each (`group`), in the groups' order, each
/// list in the items' order.
fn groups<T, G: Ord + Clone>(
    items: impl IntoIterator<Item = T>,
    group: impl Fn(&T) -> G,
    per: usize,
) -> Vec<(G, Vec<T>)> {
    let mut groups: BTreeMap<G, Vec<Vec<T>>> = BTreeMap::new();
    for item in items {
        let lists = groups.entry(group(&item)).or_default();
        match lists.last_mut() {
            Some(list) if list.len() < per => list.push(item),
            _ => lists.push(vec![item]),
        }
    }
    (groups.into_iter())
        .flat_map(|(g, lists)| lists.into_iter().map(move |l| (g.clone(), l)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn items_are_grouped_in_lists_of_at_most_per_in_order() {
        let keys = ["a1", "b1", "a2", "a3", "b2", "a4", "c1"];
        let lists = groups(keys, |k| k.as_bytes()[0], 2);
        let got: Vec<(char, Vec<&str>)> = (lists.into_iter())
            .map(|(g, l)| (char::from(g), l))
            .collect();
        assert_eq!(
            got,
            [
                ('a', vec!["a1", "a2"]),
                ('a', vec!["a3", "a4"]),
                ('b', vec!["b1", "b2"]),
                ('c', vec!["c1"]),
            ]
        );
        let one = groups(keys, |_| (), 3);
        assert_eq!(one.len(), 3);
        assert_eq!(one[2].1, ["c1"]);
    }
}
