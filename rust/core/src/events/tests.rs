//! Decoder tests: the golden frames of `specs/kv-events.md`, typed rejections, and
//! proptests (arbitrary and mutated bytes never panic; encode → decode round trips).

use proptest::prelude::*;

use super::*;

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

const GOLDEN_0: &str = "93cb41d954fc4020000091de000aa474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657392cfda7a5e7f00d5eed1cffeedfacecafebeefb1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e616d65c0aa65787472615f6b65797392c0c0a967726f75705f6964780000";
const GOLDEN_1: &str = "93cb41d954fc405000009284a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cffeedfacecafebeefa66d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172656400";
const GOLDEN_2: &str = "93cb41d954fc4080000091de000ca474797065ab426c6f636b53746f726564ac626c6f636b5f68617368657391c420000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1fb1706172656e745f626c6f636b5f68617368c4200000000000000000000000000000000000000000000000000000000000000000a9746f6b656e5f696473940708090aaa626c6f636b5f73697a6504a76c6f72615f696403a66d656469756da3475055a96c6f72615f6e616d65a76d792d6c6f7261aa65787472615f6b6579739193a76d792d6c6f726192a66d6d6861736800a473616c74a967726f75705f69647801aa73657373696f6e5f6964a27331b36c6f6f6b61686561645f746f6b656e5f69647391910b00";

#[test]
fn golden_frame_0_block_stored_with_int_hashes() {
    let batch = decode_batch(&hex(GOLDEN_0)).unwrap();
    let expected = EventBatch {
        ts: 1700000000.5,
        dp_rank: Some(0),
        events: vec![Event::BlockStored(BlockStored {
            block_hashes: vec![15742999346994867921, 18369614221190020847],
            parent_block_hash: None,
            token_ids: (1..=8).collect(),
            block_size: 4,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            extra_keys: vec![None, None],
            group_idx: 0,
            cache_salt: None,
        })],
    };
    assert_eq!(batch, expected);
}

#[test]
fn golden_frame_1_removed_then_cleared() {
    let batch = decode_batch(&hex(GOLDEN_1)).unwrap();
    assert_eq!(batch.ts, 1700000001.25);
    assert_eq!(batch.dp_rank, Some(0));
    assert_eq!(
        batch.events,
        vec![
            Event::BlockRemoved(BlockRemoved {
                block_hashes: vec![18369614221190020847],
                medium: Medium::Gpu,
                group_idx: 0,
            }),
            Event::AllBlocksCleared,
        ]
    );
}

#[test]
fn golden_frame_2_bytes_hashes_lora_extra_keys_group() {
    let batch = decode_batch(&hex(GOLDEN_2)).unwrap();
    assert_eq!(batch.ts, 1700000002.0);
    let Event::BlockStored(ev) = &batch.events[0] else {
        panic!("{batch:?}")
    };
    assert_eq!(batch.events.len(), 1);
    // Last 8 bytes of 00 01 .. 1f, big-endian; the parent digest is all zeros.
    assert_eq!(ev.block_hashes, vec![0x18191a1b1c1d1e1f]);
    assert_eq!(ev.parent_block_hash, Some(0));
    assert_eq!(ev.token_ids, vec![7, 8, 9, 10]);
    assert_eq!((ev.block_size, ev.lora_id, ev.group_idx), (4, Some(3), 1));
    assert_eq!(ev.lora_name.as_deref(), Some("my-lora"));
    assert_eq!(
        ev.extra_keys,
        vec![Some(vec![
            ExtraKey::Str("my-lora".into()),
            ExtraKey::Mm {
                hash: "mmhash".into(),
                offset: 0
            },
            ExtraKey::Str("salt".into()),
        ])]
    );
}

#[test]
fn every_truncation_of_a_golden_frame_is_an_error() {
    for frame in [GOLDEN_0, GOLDEN_1, GOLDEN_2] {
        let bytes = hex(frame);
        for cut in 0..bytes.len() {
            assert!(
                decode_batch(&bytes[..cut]).is_err(),
                "prefix of {cut} bytes accepted"
            );
        }
    }
}

fn err(bytes: &[u8]) -> DecodeError {
    decode_batch(bytes).expect_err("malformed input accepted")
}

#[test]
fn absurd_length_prefixes_are_rejected_before_allocating() {
    // [ts, [["BlockRemoved", [bin32 of 2 GiB ...]]]]
    let mut two_gib = vec![0x92, 0xcb];
    two_gib.extend_from_slice(&[0; 8]);
    two_gib.extend_from_slice(&[0x91, 0x92, 0xac]);
    two_gib.extend_from_slice(b"BlockRemoved");
    two_gib.extend_from_slice(&[0x91, 0xc6, 0x80, 0, 0, 0, 1, 2, 3]);
    let e = err(&two_gib);
    assert!(
        e.message.starts_with("events[0].block_hashes: truncated"),
        "{e}"
    );
    // An events array that declares 4 G elements.
    let mut huge = vec![0x92, 0xcb];
    huge.extend_from_slice(&[0; 8]);
    huge.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    let e = err(&huge);
    assert!(e.message.contains("4294967295"), "{e}");
    assert_eq!(e.offset, 10);
}

#[test]
fn errors_name_the_event_and_the_field() {
    // [1.0, [["BlockStored", [1], nil, [1, -1], 2]], 0]
    let mut b = vec![0x93, 0xcb];
    b.extend_from_slice(&1.0f64.to_be_bytes());
    b.extend_from_slice(&[0x91, 0x95, 0xab]);
    b.extend_from_slice(b"BlockStored");
    b.extend_from_slice(&[0x91, 0x01, 0xc0, 0x92, 0x01, 0xff, 0x02, 0x00]);
    let e = err(&b);
    assert!(
        e.message.starts_with("events[0].token_ids: token_ids[1]"),
        "{e}"
    );
    assert_eq!(e.offset, b.len() - 3);
}

fn nested(depth: usize) -> Vec<u8> {
    let mut out = vec![0x91; depth];
    out.push(0x00);
    out
}

#[test]
fn unknown_values_are_skipped_up_to_the_depth_limit() {
    let event = |value: &[u8]| {
        let mut b = vec![0x93, 0x00, 0x91, 0x82, 0xa4];
        b.extend_from_slice(b"type");
        b.push(0xb0);
        b.extend_from_slice(b"AllBlocksCleared");
        b.extend_from_slice(&[0xa6]);
        b.extend_from_slice(b"future");
        b.extend_from_slice(value);
        b.push(0xc0);
        b
    };
    // The value sits at depth 4; containers up to MAX_DEPTH are fine.
    let ok = decode_batch(&event(&nested(MAX_DEPTH - 3))).unwrap();
    assert_eq!(ok.events, vec![Event::AllBlocksCleared]);
    assert_eq!(ok.dp_rank, None);
    let e = err(&event(&nested(MAX_DEPTH - 2)));
    assert!(e.message.contains("nesting deeper"), "{e}");
}

// ---- a small encoder for the round-trip property ------------------------------------

#[derive(Debug, Clone)]
enum WireHash {
    U(u64),
    I(i64),
    B(Vec<u8>),
}

impl WireHash {
    fn value(&self) -> u64 {
        match self {
            WireHash::U(v) => *v,
            WireHash::I(v) => *v as u64,
            WireHash::B(b) => u64::from_be_bytes(b[b.len() - 8..].try_into().unwrap()),
        }
    }
    fn write(&self, out: &mut Vec<u8>) {
        match self {
            WireHash::U(v) => rmp::encode::write_uint(out, *v).map(|_| ()).unwrap(),
            WireHash::I(v) => rmp::encode::write_sint(out, *v).map(|_| ()).unwrap(),
            WireHash::B(b) => rmp::encode::write_bin(out, b).unwrap(),
        }
    }
}

/// Per block: nil, or items that are a str (`None` offset) or an `[mm_hash, offset]` pair.
type WireExtra = Option<Vec<Option<Vec<(String, Option<i64>)>>>>;

#[derive(Debug, Clone)]
enum WireEvent {
    Stored {
        hashes: Vec<WireHash>,
        parent: Option<WireHash>,
        tokens: Vec<u32>,
        block_size: u32,
        lora_id: Option<i64>,
        medium: Option<String>,
        extra: WireExtra,
        group: Option<u32>,
    },
    Removed {
        hashes: Vec<WireHash>,
        medium: Option<String>,
        group: Option<u32>,
    },
    Cleared,
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    rmp::encode::write_str(out, s).unwrap();
}

fn write_opt_str(out: &mut Vec<u8>, s: &Option<String>) {
    match s {
        Some(s) => write_str(out, s),
        None => rmp::encode::write_nil(out).unwrap(),
    }
}

impl WireEvent {
    /// (name, writer) pairs in declaration order; `None` writer = nil / absent.
    fn write(&self, out: &mut Vec<u8>, positional: bool) {
        type Field<'a> = (&'static str, Option<Box<dyn Fn(&mut Vec<u8>) + 'a>>);
        let hashes = |hs: &[WireHash], out: &mut Vec<u8>| {
            rmp::encode::write_array_len(out, hs.len() as u32).unwrap();
            hs.iter().for_each(|h| h.write(out));
        };
        let (tag, fields, required): (&str, Vec<Field<'_>>, usize) = match self {
            WireEvent::Stored {
                hashes: hs,
                parent,
                tokens,
                block_size,
                lora_id,
                medium,
                extra,
                group,
            } => (
                "BlockStored",
                vec![
                    (
                        "block_hashes",
                        Some(Box::new(move |o: &mut Vec<u8>| hashes(hs, o))),
                    ),
                    (
                        "parent_block_hash",
                        parent
                            .as_ref()
                            .map(|p| Box::new(move |o: &mut Vec<u8>| p.write(o)) as _),
                    ),
                    (
                        "token_ids",
                        Some(Box::new(move |o: &mut Vec<u8>| {
                            rmp::encode::write_array_len(o, tokens.len() as u32).unwrap();
                            tokens.iter().for_each(|t| {
                                rmp::encode::write_uint(o, *t as u64).unwrap();
                            });
                        })),
                    ),
                    (
                        "block_size",
                        Some(Box::new(move |o: &mut Vec<u8>| {
                            rmp::encode::write_uint(o, *block_size as u64).unwrap();
                        })),
                    ),
                    (
                        "lora_id",
                        lora_id.map(|v| {
                            Box::new(move |o: &mut Vec<u8>| {
                                rmp::encode::write_sint(o, v).unwrap();
                            }) as _
                        }),
                    ),
                    (
                        "medium",
                        medium
                            .as_ref()
                            .map(|m| Box::new(move |o: &mut Vec<u8>| write_str(o, m)) as _),
                    ),
                    ("lora_name", None),
                    (
                        "extra_keys",
                        extra.as_ref().map(|blocks| {
                            Box::new(move |o: &mut Vec<u8>| {
                                rmp::encode::write_array_len(o, blocks.len() as u32).unwrap();
                                for block in blocks {
                                    match block {
                                        None => rmp::encode::write_nil(o).unwrap(),
                                        Some(items) => {
                                            rmp::encode::write_array_len(o, items.len() as u32)
                                                .unwrap();
                                            for (s, off) in items {
                                                match off {
                                                    None => write_str(o, s),
                                                    Some(off) => {
                                                        rmp::encode::write_array_len(o, 2).unwrap();
                                                        write_str(o, s);
                                                        rmp::encode::write_sint(o, *off).unwrap();
                                                    }
                                                }
                                            }
                                        }
                                    }
                                }
                            }) as _
                        }),
                    ),
                    (
                        "group_idx",
                        group.map(|g| {
                            Box::new(move |o: &mut Vec<u8>| {
                                rmp::encode::write_uint(o, g as u64).unwrap();
                            }) as _
                        }),
                    ),
                    (
                        "session_id",
                        Some(Box::new(|o: &mut Vec<u8>| {
                            write_opt_str(o, &Some("s".into()))
                        })),
                    ),
                ],
                7,
            ),
            WireEvent::Removed {
                hashes: hs,
                medium,
                group,
            } => (
                "BlockRemoved",
                vec![
                    (
                        "block_hashes",
                        Some(Box::new(move |o: &mut Vec<u8>| hashes(hs, o))),
                    ),
                    (
                        "medium",
                        medium
                            .as_ref()
                            .map(|m| Box::new(move |o: &mut Vec<u8>| write_str(o, m)) as _),
                    ),
                    (
                        "group_idx",
                        group.map(|g| {
                            Box::new(move |o: &mut Vec<u8>| {
                                rmp::encode::write_uint(o, g as u64).unwrap();
                            }) as _
                        }),
                    ),
                ],
                2,
            ),
            WireEvent::Cleared => ("AllBlocksCleared", vec![], 0),
        };
        if positional {
            let last = fields
                .iter()
                .rposition(|(_, w)| w.is_some())
                .map_or(0, |i| i + 1);
            let count = last.max(required);
            rmp::encode::write_array_len(out, 1 + count as u32).unwrap();
            write_str(out, tag);
            for (_, w) in &fields[..count] {
                match w {
                    Some(w) => w(out),
                    None => rmp::encode::write_nil(out).unwrap(),
                }
            }
        } else {
            let present: Vec<_> = fields
                .iter()
                .enumerate()
                .filter(|(i, (_, w))| *i < required || w.is_some())
                .map(|(_, f)| f)
                .collect();
            rmp::encode::write_map_len(out, 1 + present.len() as u32).unwrap();
            write_str(out, "type");
            write_str(out, tag);
            for (name, w) in present {
                write_str(out, name);
                match w {
                    Some(w) => w(out),
                    None => rmp::encode::write_nil(out).unwrap(),
                }
            }
        }
    }

    fn decoded(&self) -> Event {
        match self {
            WireEvent::Stored {
                hashes,
                parent,
                tokens,
                block_size,
                lora_id,
                medium,
                extra,
                group,
            } => Event::BlockStored(BlockStored {
                block_hashes: hashes.iter().map(WireHash::value).collect(),
                parent_block_hash: parent.as_ref().map(WireHash::value),
                token_ids: tokens.clone(),
                block_size: *block_size,
                lora_id: *lora_id,
                medium: Medium::parse(medium.as_deref()),
                lora_name: None,
                extra_keys: extra
                    .clone()
                    .unwrap_or_default()
                    .into_iter()
                    .map(|b| {
                        b.map(|items| {
                            items
                                .into_iter()
                                .map(|(s, off)| match off {
                                    None => ExtraKey::Str(s),
                                    Some(offset) => ExtraKey::Mm { hash: s, offset },
                                })
                                .collect()
                        })
                    })
                    .collect(),
                group_idx: group.unwrap_or(0),
                cache_salt: None,
            }),
            WireEvent::Removed {
                hashes,
                medium,
                group,
            } => Event::BlockRemoved(BlockRemoved {
                block_hashes: hashes.iter().map(WireHash::value).collect(),
                medium: Medium::parse(medium.as_deref()),
                group_idx: group.unwrap_or(0),
            }),
            WireEvent::Cleared => Event::AllBlocksCleared,
        }
    }
}

fn wire_hash() -> impl Strategy<Value = WireHash> {
    prop_oneof![
        any::<u64>().prop_map(WireHash::U),
        (i64::MIN..0).prop_map(WireHash::I),
        proptest::collection::vec(any::<u8>(), 8..=32).prop_map(WireHash::B),
    ]
}

fn medium() -> impl Strategy<Value = Option<String>> {
    proptest::option::of(prop_oneof![
        Just("GPU".to_string()),
        Just("cpu".to_string()),
        Just("CPU_PINNED".to_string()),
        Just("STORAGE".to_string()),
        "[a-zA-Z_]{0,8}",
    ])
}

fn wire_event() -> impl Strategy<Value = WireEvent> {
    let item = ("\\PC{0,6}", proptest::option::of(any::<i64>()));
    let extra = proptest::option::of(proptest::collection::vec(
        proptest::option::of(proptest::collection::vec(item, 0..3)),
        0..4,
    ));
    let stored = (
        proptest::collection::vec(wire_hash(), 0..4),
        proptest::option::of(wire_hash()),
        proptest::collection::vec(any::<u32>(), 0..40),
        1..=u32::MAX,
        proptest::option::of(any::<i64>()),
        medium(),
        extra,
        proptest::option::of(any::<u32>()),
    )
        .prop_map(
            |(hashes, parent, tokens, block_size, lora_id, medium, extra, group)| {
                WireEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    block_size,
                    lora_id,
                    medium,
                    extra,
                    group,
                }
            },
        );
    let removed = (
        proptest::collection::vec(wire_hash(), 0..4),
        medium(),
        proptest::option::of(any::<u32>()),
    )
        .prop_map(|(hashes, medium, group)| WireEvent::Removed {
            hashes,
            medium,
            group,
        });
    prop_oneof![stored, removed, Just(WireEvent::Cleared)]
}

fn encode(ts: f64, events: &[WireEvent], dp_rank: Option<i64>, positional: bool) -> Vec<u8> {
    let mut out = Vec::new();
    rmp::encode::write_array_len(&mut out, if dp_rank.is_some() { 3 } else { 2 }).unwrap();
    rmp::encode::write_f64(&mut out, ts).unwrap();
    rmp::encode::write_array_len(&mut out, events.len() as u32).unwrap();
    for e in events {
        e.write(&mut out, positional);
    }
    if let Some(rank) = dp_rank {
        rmp::encode::write_sint(&mut out, rank).unwrap();
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn arbitrary_bytes_after_a_batch_header_never_panic(
        tail in proptest::collection::vec(any::<u8>(), 0..256)
    ) {
        let mut bytes = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0];
        bytes.extend_from_slice(&tail);
        let _ = decode_batch(&bytes);
    }

    #[test]
    fn round_trip(
        ts in -1e12f64..1e12,
        events in proptest::collection::vec(wire_event(), 0..5),
        dp_rank in proptest::option::of(any::<i64>()),
        positional in any::<bool>(),
    ) {
        let bytes = encode(ts, &events, dp_rank, positional);
        let batch = decode_batch(&bytes).unwrap();
        prop_assert_eq!(batch.ts, ts);
        prop_assert_eq!(batch.dp_rank, dp_rank);
        let expected: Vec<Event> = events.iter().map(WireEvent::decoded).collect();
        prop_assert_eq!(batch.events, expected);
    }

    #[test]
    fn mutated_valid_batches_never_panic(
        events in proptest::collection::vec(wire_event(), 1..4),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..4),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut bytes = encode(1.0, &events, Some(0), false);
        for (at, value) in flips {
            let i = at.index(bytes.len());
            bytes[i] = value;
        }
        let _ = decode_batch(&bytes);
        let _ = decode_batch(&bytes[..cut.index(bytes.len())]);
    }

    /// `decode_batch_into` appends to flat buffers that already hold other batches:
    /// each batch's events read back (borrowed) as `decode_batch` gives them, and a
    /// payload that fails (mutated or cut) leaves the buffers exactly as they were,
    /// with the same error as `decode_batch`.
    #[test]
    fn flat_decoding_appends_and_undoes_failures(
        batches in proptest::collection::vec(
            (
                proptest::collection::vec(wire_event(), 0..4),
                any::<bool>(),
                proptest::option::of((any::<prop::sample::Index>(), any::<u8>())),
                proptest::option::of(any::<prop::sample::Index>()),
            ),
            1..5,
        ),
    ) {
        let mut flat = FlatEvents::default();
        let mut kept: Vec<(BatchHeader, EventBatch)> = vec![];
        for (events, positional, flip, cut) in batches {
            let mut bytes = encode(2.0, &events, Some(1), positional);
            if let Some((at, value)) = flip {
                let i = at.index(bytes.len());
                bytes[i] = value;
            }
            if let Some(cut) = cut {
                bytes.truncate(cut.index(bytes.len() + 1));
            }
            let before = flat.clone();
            match (decode_batch_into(&bytes, &mut flat), decode_batch(&bytes)) {
                (Ok(header), Ok(batch)) => {
                    prop_assert_eq!(header.ts.to_bits(), batch.ts.to_bits());
                    prop_assert_eq!(header.dp_rank, batch.dp_rank);
                    kept.push((header, batch));
                }
                (Err(a), Err(b)) => {
                    prop_assert_eq!(a, b);
                    prop_assert_eq!(&flat.hashes, &before.hashes);
                    prop_assert_eq!(&flat.tokens, &before.tokens);
                    prop_assert_eq!(&flat.events, &before.events);
                }
                (a, b) => prop_assert!(false, "flat {:?}, owned {:?}", a, b),
            }
        }
        for (header, batch) in &kept {
            prop_assert_eq!(header.events.len(), batch.events.len());
            for (i, event) in header.events.clone().zip(&batch.events) {
                prop_assert_eq!(format!("{:?}", flat.get(i)), format!("{:?}", event.as_ref()));
            }
        }
    }
}

/// A token as some encoder may write it: minimal width or not, signed markers, or an
/// invalid value (negative, beyond u32, not an int). `Ok(v)` = decodes to `v`.
fn wire_token() -> impl Strategy<Value = (Vec<u8>, Result<u32, ()>)> {
    use rmp::encode as e;
    prop_oneof![
        4 => any::<u32>().prop_map(|v| { let mut o = vec![]; e::write_uint(&mut o, v as u64).unwrap(); (o, Ok(v)) }),
        2 => (0u32..128).prop_map(|v| (vec![v as u8], Ok(v))),
        2 => any::<u16>().prop_map(|v| { let mut o = vec![]; e::write_u16(&mut o, v).unwrap(); (o, Ok(v as u32)) }),
        1 => any::<u8>().prop_map(|v| { let mut o = vec![]; e::write_u8(&mut o, v).unwrap(); (o, Ok(v as u32)) }),
        1 => any::<u32>().prop_map(|v| { let mut o = vec![]; e::write_u32(&mut o, v).unwrap(); (o, Ok(v)) }),
        1 => any::<u32>().prop_map(|v| { let mut o = vec![]; e::write_u64(&mut o, v as u64).unwrap(); (o, Ok(v)) }),
        1 => (0i32..i32::MAX).prop_map(|v| { let mut o = vec![]; e::write_i32(&mut o, v).unwrap(); (o, Ok(v as u32)) }),
        1 => (i64::MIN..0).prop_map(|v| { let mut o = vec![]; e::write_sint(&mut o, v).unwrap(); (o, Err(())) }),
        1 => (1u64 << 32..u64::MAX).prop_map(|v| { let mut o = vec![]; e::write_u64(&mut o, v).unwrap(); (o, Err(())) }),
        1 => Just((vec![0xa1, b'x'], Err(()))),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Token arrays of every width, mostly valid: the bulk fast path and the general
    /// path agree with element-by-element expectations, and the first invalid element
    /// is the one named in the error.
    #[test]
    fn token_arrays_of_mixed_widths(
        tokens in proptest::collection::vec(wire_token(), 0..64),
    ) {
        check_token_array(&tokens)?;
    }

    /// Mostly uint16 ids (the common case, decoded four at a time), with other
    /// widths and invalid elements at any position of a run.
    #[test]
    fn token_arrays_of_uint16_runs(
        tokens in proptest::collection::vec(
            prop_oneof![
                24 => any::<u16>().prop_map(|v| {
                    let mut o = vec![];
                    rmp::encode::write_u16(&mut o, v).unwrap();
                    (o, Ok(v as u32))
                }),
                2 => wire_token(),
            ],
            0..80,
        ),
    ) {
        check_token_array(&tokens)?;
    }
}

/// Decodes a BlockStored with these token elements: the values, or an error that
/// names the first invalid element.
fn check_token_array(tokens: &[(Vec<u8>, Result<u32, ()>)]) -> Result<(), TestCaseError> {
    {
        let mut bytes = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x91, 0x84];
        write_str(&mut bytes, "type");
        write_str(&mut bytes, "BlockStored");
        write_str(&mut bytes, "block_hashes");
        bytes.push(0x90);
        write_str(&mut bytes, "token_ids");
        rmp::encode::write_array_len(&mut bytes, tokens.len() as u32).unwrap();
        for (raw, _) in tokens {
            bytes.extend_from_slice(raw);
        }
        write_str(&mut bytes, "block_size");
        bytes.push(1);
        bytes.push(0);
        let first_bad = tokens.iter().position(|(_, v)| v.is_err());
        match (decode_batch(&bytes), first_bad) {
            (Ok(batch), None) => {
                let want: Vec<u32> = tokens.iter().map(|(_, v)| v.unwrap()).collect();
                match &batch.events[0] {
                    Event::BlockStored(ev) => prop_assert_eq!(&ev.token_ids, &want),
                    other => prop_assert!(false, "decoded {:?}", other),
                }
            }
            (Err(e), Some(i)) => {
                let needle = format!("token_ids[{i}]");
                prop_assert!(e.message.contains(&needle), "{}", e.message);
            }
            (got, bad) => prop_assert!(false, "decoded {:?}, first bad element {:?}", got, bad),
        }
    }
    Ok(())
}

// --- StoredIdentity: the namespace and multimodal rule of a BlockStored ------------

#[test]
fn identity_of_golden_frame_2_skips_the_lora_name_for_the_salt() {
    let batch = decode_batch(&hex(GOLDEN_2)).unwrap();
    let Event::BlockStored(ev) = &batch.events[0] else {
        panic!("a BlockStored");
    };
    let id = ev.as_ref().identity();
    assert_eq!(id.lora(), "my-lora");
    assert_eq!(id.tenant(), "salt");
    assert_eq!(id.mm_items(0), Some(vec![("mmhash".to_owned(), 0)]));
    assert_eq!(id.mm_items(1), None);
    let ns = id.namespace("m".into(), "t".into(), 4);
    assert_eq!((ns.lora.as_str(), ns.tenant.as_str()), ("my-lora", "salt"));
    assert_eq!((ns.model.as_str(), ns.tokenizer.as_str()), ("m", "t"));
    assert_eq!((ns.block_size, ns.extra.len()), (4, 0));
}

#[test]
fn identity_tenant_rule() {
    let s = |v: &str| ExtraKey::Str(v.to_owned());
    let mm = |h: &str, o: i64| ExtraKey::Mm {
        hash: h.to_owned(),
        offset: o,
    };
    let keys = vec![Some(vec![mm("h", 1), s("lora"), s("salt"), s("later")])];
    let id = |cache_salt, lora_name, extra_keys| StoredIdentity {
        cache_salt,
        lora_name,
        extra_keys,
    };
    // The field wins, even when empty; else the first string that is not the LoRA name.
    assert_eq!(id(Some("field"), Some("lora"), &keys).tenant(), "field");
    assert_eq!(id(Some(""), Some("lora"), &keys).tenant(), "");
    assert_eq!(id(None, Some("lora"), &keys).tenant(), "salt");
    assert_eq!(id(None, None, &keys).tenant(), "lora");
    assert_eq!(id(None, None, &keys).lora(), "");
    // Only block 0 carries the salt.
    let later = vec![None, Some(vec![s("salt")])];
    assert_eq!(id(None, None, &later).tenant(), "");
    assert_eq!(id(None, None, &[]).tenant(), "");
    // A block's mm items keep the engine's order; raw and string keys are not items.
    let blocks = vec![
        Some(vec![
            mm("a", 3),
            ExtraKey::Raw(vec![0xc0]),
            s("x"),
            mm("b", 0),
        ]),
        Some(vec![s("x")]),
        None,
    ];
    let ident = id(None, None, &blocks);
    let items = ident.mm_items(0).unwrap();
    assert_eq!(items, vec![("a".to_owned(), 3), ("b".to_owned(), 0)]);
    assert_eq!(ident.mm_items(1), None);
    assert_eq!(ident.mm_items(2), None);
    assert_eq!(ident.mm_items(3), None);
}

/// SGLang's golden frames (`tests/vectors/sglang_kv_events.json`, made by the
/// publisher code of five releases): each decodes to what SGLang was asked to send.
/// Hashes are SGLang's signed int64 (decoded by their bits); the salt is the field
/// (>= 0.5.20) or the metadata map (0.5.18-0.5.19); `session_id` is not kept.
#[test]
fn sglang_golden_frames_of_every_release() {
    use serde_json::Value;
    let doc: Value = serde_json::from_str(include_str!(
        "../../../../tests/vectors/sglang_kv_events.json"
    ))
    .unwrap();
    let hash = |v: &Value| v.as_i64().unwrap() as u64;
    let opt_str = |e: &Value, k: &str| e.get(k).and_then(Value::as_str).map(str::to_owned);
    let mut checked = 0;
    for (release, r) in doc["releases"].as_object().unwrap() {
        for (layer, frames) in r["frames"].as_object().unwrap() {
            for f in frames.as_array().unwrap() {
                let payload = match f.get("frames_hex") {
                    Some(fr) => hex(fr[2].as_str().unwrap()),
                    None => hex(f["payload_hex"].as_str().unwrap()),
                };
                let sent = &f["sent"];
                let events = sent["events"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|e| match e["type"].as_str().unwrap() {
                        "BlockStored" => Event::BlockStored(BlockStored {
                            block_hashes: e["block_hashes"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .map(hash)
                                .collect(),
                            parent_block_hash: e["parent_block_hash"].as_i64().map(|h| h as u64),
                            token_ids: e["token_ids"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .map(|t| t.as_u64().unwrap() as u32)
                                .collect(),
                            block_size: e["block_size"].as_u64().unwrap() as u32,
                            lora_id: e["lora_id"].as_i64(),
                            medium: Medium::parse(e.get("medium").and_then(Value::as_str)),
                            lora_name: opt_str(e, "lora_name"),
                            extra_keys: vec![],
                            group_idx: 0,
                            cache_salt: opt_str(e, "cache_salt").or_else(|| {
                                e.get("metadata").and_then(|m| opt_str(m, "cache_salt"))
                            }),
                        }),
                        "BlockRemoved" => Event::BlockRemoved(BlockRemoved {
                            block_hashes: e["block_hashes"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .map(hash)
                                .collect(),
                            medium: Medium::parse(e.get("medium").and_then(Value::as_str)),
                            group_idx: 0,
                        }),
                        _ => Event::AllBlocksCleared,
                    })
                    .collect();
                let expected = EventBatch {
                    ts: sent["ts"].as_f64().unwrap(),
                    events,
                    dp_rank: sent["attn_dp_rank"].as_i64(),
                };
                let got =
                    decode_batch(&payload).unwrap_or_else(|e| panic!("{release} {layer}: {e}"));
                assert_eq!(got, expected, "{release} {layer}");
                checked += 1;
            }
        }
    }
    assert_eq!(checked, 5 * 9);
}

fn sglang_array_stored(tail: &[u8]) -> Vec<u8> {
    // [1.0, [["BlockStored", [-5], nil, [1, 2], 2, nil, "GPU", <tail>]], 0]
    let mut p = hex("93cb3ff00000000000009198ab426c6f636b53746f72656491fbc092010202c0a3475055");
    p.extend_from_slice(tail);
    p.push(0x00);
    p
}

#[test]
fn sglang_metadata_map_at_lora_name_is_the_salt() {
    // {"future": [1], "cache_salt": "t"}: the unknown key is skipped
    let b = decode_batch(&sglang_array_stored(&hex(
        "82a66675747572659101aa63616368655f73616c74a174",
    )))
    .unwrap();
    let Event::BlockStored(s) = &b.events[0] else {
        panic!()
    };
    assert_eq!(
        (s.cache_salt.as_deref(), s.lora_name.as_deref()),
        (Some("t"), None)
    );
    assert_eq!(s.block_hashes, vec![(-5i64) as u64]);
    // a str there is still vLLM's lora_name
    let b = decode_batch(&sglang_array_stored(&hex("a16c"))).unwrap();
    let Event::BlockStored(s) = &b.events[0] else {
        panic!()
    };
    assert_eq!(
        (s.cache_salt.as_deref(), s.lora_name.as_deref()),
        (None, Some("l"))
    );
    // a salt that is not a str, a key that is not a str: errors naming the metadata
    for bad in ["81aa63616368655f73616c7407", "8101a178"] {
        let err = decode_batch(&sglang_array_stored(&hex(bad))).unwrap_err();
        assert!(err.message.starts_with("events[0].metadata"), "{err}");
    }
}
