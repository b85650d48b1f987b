//! BTF's answers, recorded: the questions the layout readers asked of this
//! kernel's BTF and what it said, as plain data for a kernel description.
//! Replayed, the facts answer the same questions the same way, so a plan
//! made from a recorded kernel reads the same layouts, and gives the same
//! reasons, as one made on that kernel.

use std::{cell::RefCell, collections::BTreeMap};

use serde::{Deserialize, Serialize};

use super::{Btf, BtfError, Layouts};

/// Why BTF gave no answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    /// It lacks the type or member named.
    Missing(String),
    /// Anything else, in the words of the error.
    Other(String),
}

impl From<&BtfError> for Refusal {
    fn from(e: &BtfError) -> Self {
        match e {
            BtfError::Missing(what) => Refusal::Missing(what.clone()),
            other => Refusal::Other(other.to_string()),
        }
    }
}

impl From<Refusal> for BtfError {
    fn from(r: Refusal) -> Self {
        match r {
            Refusal::Missing(what) => BtfError::Missing(what),
            Refusal::Other(text) => BtfError::Recorded(text),
        }
    }
}

/// Answers by question.
type Answers<T> = BTreeMap<String, Result<T, Refusal>>;

/// What a kernel's BTF answered to each question the layout readers ask.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BtfFacts {
    /// `struct.member`: (byte offset, size).
    pub members: Answers<(u32, u32)>,
    /// Struct name: its size.
    pub struct_sizes: Answers<u32>,
    /// `enum.ENUMERATOR`: its value.
    pub enum_values: Answers<u64>,
    /// Tracepoint: what each argument points to.
    pub tracepoint_args: Answers<Vec<String>>,
}

impl BtfFacts {
    /// Asks `btf` every question the layout readers ask, and keeps the
    /// answers.
    pub fn record(btf: &Btf) -> Self {
        let recorder = Recorder {
            btf,
            facts: RefCell::default(),
        };
        // Only the questions matter here: replaying the facts gives each
        // reader's result again.
        let _ = super::send_offsets(&recorder);
        let _ = super::task_offsets(&recorder);
        let _ = super::segment_offsets(&recorder);
        let _ = super::skb_ack_seq_offset(&recorder);
        let _ = super::netns_offsets(&recorder);
        recorder.facts.into_inner()
    }
}

#[cfg(test)]
impl BtfFacts {
    /// As on a kernel without `tracepoint` (for deriving a description
    /// from a recorded one): its prototype is missing, as `Btf` says it.
    pub fn without_tracepoint(&mut self, tracepoint: &str) {
        let missing = Refusal::Missing(format!("btf_trace_{tracepoint}"));
        self.tracepoint_args
            .insert(tracepoint.to_string(), Err(missing));
    }
}

fn replay<T: Clone>(answers: &Answers<T>, question: &str) -> Result<T, BtfError> {
    match answers.get(question) {
        Some(answer) => answer.clone().map_err(BtfError::from),
        None => Err(BtfError::Recorded(format!(
            "BTF: {question} is not in the recorded kernel description"
        ))),
    }
}

impl Layouts for BtfFacts {
    fn member(&self, strukt: &str, member: &str) -> Result<(u32, u32), BtfError> {
        replay(&self.members, &format!("{strukt}.{member}"))
    }

    fn struct_size(&self, strukt: &str) -> Result<u32, BtfError> {
        replay(&self.struct_sizes, strukt)
    }

    fn enum_value(&self, ty: &str, name: &str) -> Result<u64, BtfError> {
        replay(&self.enum_values, &format!("{ty}.{name}"))
    }

    fn tracepoint_args(&self, tracepoint: &str) -> Result<Vec<String>, BtfError> {
        replay(&self.tracepoint_args, tracepoint)
    }
}

/// The kernel's BTF, with every answer it gives written down.
struct Recorder<'a> {
    btf: &'a Btf,
    facts: RefCell<BtfFacts>,
}

fn keep<T: Clone>(
    answers: &mut Answers<T>,
    question: String,
    got: Result<T, BtfError>,
) -> Result<T, BtfError> {
    answers.insert(question, got.as_ref().cloned().map_err(Refusal::from));
    got
}

impl Layouts for Recorder<'_> {
    fn member(&self, strukt: &str, member: &str) -> Result<(u32, u32), BtfError> {
        let got = self.btf.member(strukt, member);
        let question = format!("{strukt}.{member}");
        keep(&mut self.facts.borrow_mut().members, question, got)
    }

    fn struct_size(&self, strukt: &str) -> Result<u32, BtfError> {
        let got = self.btf.struct_size(strukt);
        keep(
            &mut self.facts.borrow_mut().struct_sizes,
            strukt.into(),
            got,
        )
    }

    fn enum_value(&self, ty: &str, name: &str) -> Result<u64, BtfError> {
        let got = self.btf.enum_value(ty, name);
        let question = format!("{ty}.{name}");
        keep(&mut self.facts.borrow_mut().enum_values, question, got)
    }

    fn tracepoint_args(&self, tracepoint: &str) -> Result<Vec<String>, BtfError> {
        let got = self.btf.tracepoint_args(tracepoint);
        let facts = &mut self.facts.borrow_mut().tracepoint_args;
        keep(facts, tracepoint.into(), got)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probes::btf::{builder::kernel_like, send_offsets};

    #[test]
    fn recorded_facts_read_the_same_layouts() {
        let btf = Btf::parse(&kernel_like(8)).expect("parse");
        let facts = BtfFacts::record(&btf);
        assert_eq!(
            send_offsets(&facts).expect("replayed"),
            send_offsets(&btf).expect("read")
        );
        // Through JSON and back, as a kernel description keeps them.
        let text = serde_json::to_string(&facts).expect("to JSON");
        let back: BtfFacts = serde_json::from_str(&text).expect("from JSON");
        assert_eq!(back, facts);
        // A refusal is said again in the same words.
        let err = crate::probes::btf::task_offsets(&back).expect_err("no scheduler types");
        let live = crate::probes::btf::task_offsets(&btf).expect_err("no scheduler types");
        assert_eq!(err.to_string(), live.to_string());
    }
}
