//! Kubernetes' legacy RangeAllocation (the kube-apiserver's bitmap of Service IPs, stored
//! in etcd at `/registry/ranges/serviceips` and `/registry/ranges/secondaryserviceips`).
//!
//! Accepted encodings, detected from the bytes:
//! - the value etcd holds for that key: Kubernetes' protobuf envelope (`k8s\0` followed by a
//!   `runtime.Unknown` whose `raw` field is the `v1.RangeAllocation` message);
//! - JSON: `{"range": "10.96.0.0/12", "data": "<base64>"}` (the object's JSON form; other
//!   fields are ignored).
//!
//! `data` is a big-endian big integer whose bit i marks offset i (offset 0 = the first usable
//! address); [`AllocationMap::from_range_allocation`] decodes it.

use serde::Deserialize;

use crate::alloc::AllocationMap;
use crate::cidr::ServiceCidr;

/// The two fields of a RangeAllocation that matter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RangeAllocation {
    pub range: String,
    pub data: Vec<u8>,
}

/// Why a legacy allocation could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LegacyError {
    #[error("not a RangeAllocation: {0}")]
    Malformed(String),
    #[error("RangeAllocation range {range:?}: {reason}")]
    Range { range: String, reason: String },
    #[error("RangeAllocation data for {range}: {reason}")]
    Data { range: String, reason: String },
}

const PROTOBUF_MAGIC: &[u8] = b"k8s\x00";

impl RangeAllocation {
    /// Decode either encoding.
    pub fn decode(bytes: &[u8]) -> Result<Self, LegacyError> {
        if let Some(rest) = bytes.strip_prefix(PROTOBUF_MAGIC) {
            return Self::decode_protobuf(rest);
        }
        let trimmed = bytes.iter().position(|b| !b.is_ascii_whitespace()).map(|i| &bytes[i..]).unwrap_or(&[]);
        if trimmed.first() == Some(&b'{') {
            return Self::decode_json(trimmed);
        }
        Err(LegacyError::Malformed("expected JSON or Kubernetes protobuf (k8s\\0 envelope)".into()))
    }

    fn decode_json(bytes: &[u8]) -> Result<Self, LegacyError> {
        #[derive(Deserialize)]
        struct Json {
            range: String,
            #[serde(default)]
            data: String,
        }
        use base64::Engine as _;
        let j: Json = serde_json::from_slice(bytes).map_err(|e| LegacyError::Malformed(format!("JSON: {e}")))?;
        let data = base64::engine::general_purpose::STANDARD
            .decode(j.data.as_bytes())
            .map_err(|e| LegacyError::Malformed(format!("data is not base64: {e}")))?;
        Ok(Self { range: j.range, data })
    }

    fn decode_protobuf(envelope: &[u8]) -> Result<Self, LegacyError> {
        // runtime.Unknown: 1 typeMeta, 2 raw, 3 contentEncoding, 4 contentType.
        let raw = proto_fields(envelope)?
            .into_iter()
            .find(|(field, _)| *field == 2)
            .map(|(_, v)| v)
            .ok_or_else(|| LegacyError::Malformed("protobuf envelope without an object".into()))?;
        // v1.RangeAllocation: 1 metadata, 2 range, 3 data.
        let mut out = Self { range: String::new(), data: Vec::new() };
        for (field, value) in proto_fields(raw)? {
            match field {
                2 => out.range = String::from_utf8(value.to_vec()).map_err(|_| LegacyError::Malformed("range is not UTF-8".into()))?,
                3 => out.data = value.to_vec(),
                _ => {}
            }
        }
        if out.range.is_empty() {
            return Err(LegacyError::Malformed("protobuf object has no range field".into()));
        }
        Ok(out)
    }

    /// The allocation map it describes.
    pub fn to_map(&self) -> Result<AllocationMap, LegacyError> {
        let cidr = ServiceCidr::parse(&self.range)
            .map_err(|e| LegacyError::Range { range: self.range.clone(), reason: e.to_string() })?;
        AllocationMap::from_range_allocation(&cidr, &self.data)
            .map_err(|e| LegacyError::Data { range: self.range.clone(), reason: e.to_string() })
    }
}

/// The length-delimited fields (wire type 2) of a protobuf message, as (number, bytes);
/// varint and fixed fields are skipped.
fn proto_fields(mut buf: &[u8]) -> Result<Vec<(u64, &[u8])>, LegacyError> {
    let mut out = Vec::new();
    while !buf.is_empty() {
        let key = varint(&mut buf)?;
        let (field, wire) = (key >> 3, key & 7);
        match wire {
            0 => {
                varint(&mut buf)?;
            }
            1 => buf = buf.get(8..).ok_or_else(truncated)?,
            2 => {
                let len = usize::try_from(varint(&mut buf)?).map_err(|_| truncated())?;
                let value = buf.get(..len).ok_or_else(truncated)?;
                out.push((field, value));
                buf = &buf[len..];
            }
            5 => buf = buf.get(4..).ok_or_else(truncated)?,
            _ => return Err(LegacyError::Malformed(format!("unsupported protobuf wire type {wire}"))),
        }
    }
    Ok(out)
}

fn truncated() -> LegacyError {
    LegacyError::Malformed("truncated protobuf".into())
}

fn varint(buf: &mut &[u8]) -> Result<u64, LegacyError> {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = buf.split_first().ok_or_else(truncated)?;
        *buf = rest;
        value |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(value);
        }
    }
    Err(LegacyError::Malformed("protobuf varint too long".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(n: u8, bytes: &[u8]) -> Vec<u8> {
        let mut v = vec![(n << 3) | 2, bytes.len() as u8];
        v.extend_from_slice(bytes);
        v
    }

    #[test]
    fn decodes_the_protobuf_envelope() {
        let mut obj = field(1, b"\x0a\x00"); // metadata (ignored)
        obj.extend(field(2, b"10.0.0.0/24"));
        obj.extend(field(3, &[0b0000_0101]));
        let mut env = PROTOBUF_MAGIC.to_vec();
        env.extend(field(1, b"\x0a\x02v1"));
        env.extend(field(2, &obj));
        let ra = RangeAllocation::decode(&env).expect("decode");
        assert_eq!(ra, RangeAllocation { range: "10.0.0.0/24".into(), data: vec![5] });
    }

    #[test]
    fn decodes_json() {
        let ra = RangeAllocation::decode(br#" {"kind":"RangeAllocation","range":"10.0.0.0/24","data":"BQ=="}"#).expect("decode");
        assert_eq!(ra.data, vec![5]);
    }

    #[test]
    fn garbage_is_a_clear_error() {
        for bad in [&b""[..], b"hello", b"k8s\x00\x12\xff", b"{\"range\": 3}", b"{\"range\":\"x\",\"data\":\"!!\"}"] {
            let err = RangeAllocation::decode(bad).expect_err("must fail");
            assert!(err.to_string().starts_with("not a RangeAllocation"), "{err}");
        }
    }
}
