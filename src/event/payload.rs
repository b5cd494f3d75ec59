//! An outbound event's entry id and fields in one allocation. A worker may hold a hundred
//! thousand sleeping events, so each keeps its fields packed (a length before each name and
//! value) rather than as a vector of byte vectors, which cost three allocations and about 80
//! bytes of headers per field; and its entry id as the first part, where a `Box<str>` of its
//! own took 48 bytes (its pointer and the smallest allocation) for the id's 15-20 here.

use super::Fields;

#[derive(Clone, PartialEq, Eq)]
pub struct Payload(Box<[u8]>);

impl Payload {
    /// `head` (the entry id), then `fields`.
    pub fn new<'a>(head: &[u8], fields: impl IntoIterator<Item = (&'a [u8], &'a [u8])>) -> Self {
        let mut buf = Vec::new();
        put(&mut buf, head);
        for (name, value) in fields {
            put(&mut buf, name);
            put(&mut buf, value);
        }
        Payload(buf.into_boxed_slice())
    }

    /// What came before the fields (the entry id).
    pub fn head(&self) -> &[u8] {
        PayloadIter(&self.0).part().unwrap_or_default()
    }

    /// The packed fields, after the head.
    fn fields(&self) -> &[u8] {
        &self.0[(4 + self.head().len()).min(self.0.len())..]
    }

    /// The fields, in order.
    pub fn iter(&self) -> PayloadIter<'_> {
        PayloadIter(self.fields())
    }

    /// How many fields it holds.
    pub fn count(&self) -> usize {
        self.iter().count()
    }

    /// Bytes its fields take packed (names, values and their lengths): about what a call
    /// carrying them sends, read without walking them.
    pub fn packed_len(&self) -> usize {
        self.fields().len()
    }

    /// Bytes of names and values (what `max_event_bytes` counts).
    pub fn size(&self) -> usize {
        self.iter().map(|(k, v)| k.len() + v.len()).sum()
    }

    /// The value of the first field named `name`.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.iter()
            .find(|(k, _)| *k == name.as_bytes())
            .map(|(_, v)| v)
    }

    pub fn to_fields(&self) -> Fields {
        self.iter().map(|(k, v)| (k.to_vec(), v.to_vec())).collect()
    }
}

fn put(buf: &mut Vec<u8>, part: &[u8]) {
    buf.extend_from_slice(&(part.len() as u32).to_le_bytes());
    buf.extend_from_slice(part);
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map()
            .entries(
                self.iter()
                    .map(|(k, v)| (String::from_utf8_lossy(k), String::from_utf8_lossy(v))),
            )
            .finish()
    }
}

pub struct PayloadIter<'a>(&'a [u8]);

impl<'a> PayloadIter<'a> {
    fn part(&mut self) -> Option<&'a [u8]> {
        let (len, rest) = self.0.split_first_chunk::<4>()?;
        let len = u32::from_le_bytes(*len) as usize;
        let (part, rest) = rest.split_at(len);
        self.0 = rest;
        Some(part)
    }
}

impl<'a> Iterator for PayloadIter<'a> {
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<Self::Item> {
        let name = self.part()?;
        let value = self.part()?;
        Some((name, value))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_its_head_names_values_and_order_byte_for_byte() {
        let fields: Vec<(&[u8], &[u8])> = vec![(b"route", b"a"), (b"", b""), (b"\xff\x00", b"x")];
        let p = Payload::new(b"1-0", fields.iter().copied());
        assert_eq!(p.head(), b"1-0");
        assert_eq!(p.iter().collect::<Vec<_>>(), fields);
        assert_eq!(p.count(), 3);
        assert_eq!(p.size(), 9);
        assert_eq!(p.packed_len(), 9 + 6 * 4);
        assert_eq!(p.get("route"), Some(&b"a"[..]));
        let empty = Payload::new(b"", []);
        assert_eq!(
            (empty.head(), empty.count(), empty.packed_len()),
            (&b""[..], 0, 0)
        );
    }
}
