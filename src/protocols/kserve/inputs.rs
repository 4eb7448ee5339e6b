//! A ModelInfer request's input tensors by name, each read typed or raw
//! (little-endian), with errors naming the input.

use narsil_core::{InputField, InvalidInput};

use crate::kserve_proto as pb;
use crate::kserve_proto::model_infer_request::InferInputTensor;
use crate::wire::kserve::{
    DENSE, IDS, LENGTHS, REQUEST_DENSE, REQUEST_IDS, REQUEST_LENGTHS, REQUEST_WEIGHTS, WEIGHTS,
};
use crate::wire::le;
/// One input tensor and its raw bytes, if the request sent them raw.
pub(super) struct Input<'a> {
    pub(super) tensor: &'a InferInputTensor,
    raw: Option<&'a [u8]>,
    field: InputField,
}

impl Input<'_> {
    pub(super) fn error(&self, message: String) -> InvalidInput {
        InvalidInput::new(self.field, message)
    }

    /// The element count its shape declares.
    fn count(&self) -> Result<usize, InvalidInput> {
        self.tensor.shape.iter().try_fold(1usize, |n, &d| {
            usize::try_from(d).ok().and_then(|d| n.checked_mul(d)).ok_or_else(|| {
                self.error(format!("has shape {:?}; dimensions must be non-negative", self.tensor.shape))
            })
        })
    }

    pub(super) fn check_rank(&self, rank: usize, expected: &str) -> Result<(), InvalidInput> {
        if self.tensor.shape.len() != rank {
            return Err(self.error(format!("has shape {:?}, expected {expected}", self.tensor.shape)));
        }
        Ok(())
    }

    /// The width of a request-level input, sent once: `[1, W]` or `[W]`.
    pub(super) fn request_width(&self, expected: &str) -> Result<usize, InvalidInput> {
        let shape = &self.tensor.shape;
        let width = match shape.as_slice() {
            [w] | [1, w] => usize::try_from(*w).ok(),
            _ => None,
        };
        width.ok_or_else(|| {
            self.error(format!("has shape {shape:?}, expected {expected} (sent once for all candidates)"))
        })
    }

    /// Its values as bag lengths (non-negative, 32-bit); `bag` names entry
    /// `i` in an error.
    pub(super) fn lengths(&self, bag: impl Fn(usize) -> String) -> Result<Vec<u32>, InvalidInput> {
        let wide = self.integers()?;
        if let Some(i) = wide.iter().position(|&l| u32::try_from(l).is_err()) {
            return Err(self.error(format!("{} has length {}", bag(i), wide[i])));
        }
        Ok(wide.into_iter().map(|l| l as u32).collect())
    }

    pub(super) fn floats(&self) -> Result<Vec<f32>, InvalidInput> {
        if self.tensor.datatype != "FP32" {
            return Err(self.error(format!("has datatype {}, expected FP32", self.tensor.datatype)));
        }
        let values = match self.raw {
            Some(bytes) => le::f32s(bytes)
                .ok_or_else(|| self.error(format!("has {} raw bytes, not whole FP32 values", bytes.len())))?,
            None => self.tensor.contents.as_ref().map(|c| c.fp32_contents.clone()).unwrap_or_default(),
        };
        self.counted(values)
    }

    /// INT64, INT32 or UINT64 values, as `i64`: a UINT64 value above
    /// `i64::MAX` (a raw 64-bit id) keeps its bits, two's complement.
    pub(super) fn integers(&self) -> Result<Vec<i64>, InvalidInput> {
        let width = match self.tensor.datatype.as_str() {
            "INT64" | "UINT64" => 8,
            "INT32" => 4,
            other => return Err(self.error(format!("has datatype {other}, expected INT64, INT32 or UINT64"))),
        };
        let values = match (self.raw, width) {
            (Some(bytes), _) => match width {
                8 => le::i64s(bytes),
                _ => le::i32s_wide(bytes),
            }
            .ok_or_else(|| {
                self.error(format!(
                    "has {} raw bytes, not whole {} values",
                    bytes.len(),
                    self.tensor.datatype
                ))
            })?,
            (None, 8) if self.tensor.datatype == "UINT64" => self
                .tensor
                .contents
                .as_ref()
                .map(|c| c.uint64_contents.iter().map(|&v| v as i64).collect())
                .unwrap_or_default(),
            (None, 8) => self.tensor.contents.as_ref().map(|c| c.int64_contents.clone()).unwrap_or_default(),
            (None, _) => self
                .tensor
                .contents
                .as_ref()
                .map(|c| c.int_contents.iter().map(|&v| i64::from(v)).collect())
                .unwrap_or_default(),
        };
        self.counted(values)
    }

    fn counted<T>(&self, values: Vec<T>) -> Result<Vec<T>, InvalidInput> {
        let count = self.count()?;
        if values.len() != count {
            return Err(self.error(format!(
                "has {} values for shape {:?} ({count} values)",
                values.len(),
                self.tensor.shape
            )));
        }
        Ok(values)
    }
}

/// The inputs of a ModelInfer request, by name.
#[derive(Default)]
pub(super) struct Inputs<'a> {
    pub(super) dense: Option<Input<'a>>,
    pub(super) lengths: Option<Input<'a>>,
    pub(super) ids: Option<Input<'a>>,
    pub(super) weights: Option<Input<'a>>,
    pub(super) request_dense: Option<Input<'a>>,
    pub(super) request_lengths: Option<Input<'a>>,
    pub(super) request_ids: Option<Input<'a>>,
    pub(super) request_weights: Option<Input<'a>>,
}

impl<'a> Inputs<'a> {
    pub(super) fn read(request: &'a pb::ModelInferRequest) -> Result<Self, InvalidInput> {
        let raw = &request.raw_input_contents;
        if !raw.is_empty() && raw.len() != request.inputs.len() {
            return Err(InvalidInput::new(
                InputField::Wire("raw_input_contents"),
                format!(
                    "has {} entries for {} inputs (one per input, or none)",
                    raw.len(),
                    request.inputs.len()
                ),
            ));
        }
        let mut inputs = Self::default();
        for (i, tensor) in request.inputs.iter().enumerate() {
            let (slot, field) = match tensor.name.as_str() {
                DENSE => (&mut inputs.dense, InputField::Dense),
                LENGTHS => (&mut inputs.lengths, InputField::Lengths),
                IDS => (&mut inputs.ids, InputField::Ids),
                WEIGHTS => (&mut inputs.weights, InputField::Weights),
                REQUEST_DENSE => (&mut inputs.request_dense, InputField::RequestDense),
                REQUEST_LENGTHS => (&mut inputs.request_lengths, InputField::RequestLengths),
                REQUEST_IDS => (&mut inputs.request_ids, InputField::RequestIds),
                REQUEST_WEIGHTS => (&mut inputs.request_weights, InputField::RequestWeights),
                other => {
                    return Err(InvalidInput::new(
                        InputField::Wire("inputs"),
                        format!(
                            "unknown input {other:?}; the model takes {DENSE}, {LENGTHS}, {IDS} and {WEIGHTS} \
                             (and, in a ranking request, {REQUEST_DENSE}, {REQUEST_LENGTHS}, {REQUEST_IDS} and \
                             {REQUEST_WEIGHTS})"
                        ),
                    ))
                }
            };
            if slot.is_some() {
                return Err(InvalidInput::new(field, "is given twice"));
            }
            if !raw.is_empty() && tensor.contents.is_some() {
                return Err(InvalidInput::new(field, "has contents although raw_input_contents is used"));
            }
            *slot = Some(Input { tensor, raw: raw.get(i).map(|b| b.as_ref()), field });
        }
        Ok(inputs)
    }

    /// Whether any request-level input is present (a ranking request).
    pub(super) fn grouped(&self) -> bool {
        self.request_dense.is_some()
            || self.request_lengths.is_some()
            || self.request_ids.is_some()
            || self.request_weights.is_some()
    }
}
