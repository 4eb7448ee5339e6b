//! `narsil serve --request-level`: which features of a model are the same
//! for every candidate of a ranking request, named at serve time in place
//! of what the model declares (its `model.json`, `schema.json` or
//! `narsil_schema()`).
//!
//! Each form is `MODEL:NAMES` (that model's features) or `NAMES` (the
//! model of a `--model` server); `NAMES` is comma-separated feature names,
//! `dense` for the dense features, `none` for none. The flag repeats (or
//! its variable, `NARSIL_REQUEST_LEVEL`, holds forms separated by `;`). A
//! model no form names keeps its own declaration. A repository takes
//! `MODEL:NAMES` forms only: a bare form is refused at start, since which
//! of its models it meant cannot be told (and a name one model lacks would
//! fail that model's load).

use std::collections::BTreeMap;
use std::str::FromStr;

/// The flag, for messages.
pub const FLAG: &str = "--request-level";

/// One `--request-level` form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLevelForm {
    /// The model it is for; `None` for a bare form (a `--model` server's).
    pub model: Option<String>,
    /// The request-level features' names (`dense`, `none` included).
    pub names: Vec<String>,
}

impl FromStr for RequestLevelForm {
    type Err = String;

    /// `MODEL:NAMES` or `NAMES`: a model's name holds no `:`, so the first
    /// one ends it.
    fn from_str(text: &str) -> Result<Self, String> {
        let (model, names) = match text.split_once(':') {
            Some((model, names)) => {
                let model = model.trim();
                if model.is_empty() {
                    return Err(format!("{text:?}: no model before `:` (MODEL:NAMES, or NAMES alone)"));
                }
                (Some(model.to_string()), names)
            }
            None => (None, text),
        };
        let names: Vec<String> =
            names.split(',').map(str::trim).filter(|n| !n.is_empty()).map(String::from).collect();
        if names.is_empty() {
            return Err(format!(
                "{text:?}: no feature names (comma-separated names, `dense`, or `none` for none)"
            ));
        }
        Ok(Self { model, names })
    }
}

impl std::fmt::Display for RequestLevelForm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.model {
            Some(model) => write!(f, "{model}:{}", self.names.join(",")),
            None => write!(f, "{}", self.names.join(",")),
        }
    }
}

/// Two forms for the same model (or two bare forms): refused, naming both.
fn no_repeats(forms: &[RequestLevelForm]) -> Result<(), String> {
    for (i, form) in forms.iter().enumerate() {
        if let Some(earlier) = forms[..i].iter().find(|f| f.model == form.model) {
            let whose =
                form.model.as_deref().map_or("the served model".to_string(), |m| format!("model {m}"));
            return Err(format!(
                "{FLAG} names {whose} twice ({earlier} and {form}); name all its request-level features in one form"
            ));
        }
    }
    Ok(())
}

/// The forms of a repository's server: each model's names, by model.
/// A bare form is refused, naming the form to use.
pub fn per_model(forms: &[RequestLevelForm]) -> Result<BTreeMap<String, Vec<String>>, String> {
    no_repeats(forms)?;
    let mut by_model = BTreeMap::new();
    for form in forms {
        let Some(model) = &form.model else {
            return Err(format!(
                "{FLAG} {form} names no model, and a --model-repository server needs one: write it \
                 MODEL:{form} for each model it is for (a model no form names keeps its own declaration)"
            ));
        };
        by_model.insert(model.clone(), form.names.clone());
    }
    Ok(by_model)
}

/// The forms of a `--model` server serving `model`: the names for it (a
/// bare form, or `model:`'s), or none to keep its own declaration. A form
/// for another model is refused, naming the model served.
pub fn for_single_model(forms: &[RequestLevelForm], model: &str) -> Result<Option<Vec<String>>, String> {
    no_repeats(forms)?;
    let mut names = None;
    for form in forms {
        match &form.model {
            Some(other) if other != model => {
                return Err(format!(
                    "{FLAG} {form} is for model {other}, and this server serves one model, {model} \
                     (write {model}:{}, or the names alone)",
                    form.names.join(",")
                ))
            }
            _ if names.is_some() => {
                return Err(format!(
                    "{FLAG} names the served model {model} twice; name all its request-level features in one form"
                ))
            }
            _ => names = Some(form.names.clone()),
        }
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn forms(texts: &[&str]) -> Vec<RequestLevelForm> {
        texts.iter().map(|t| t.parse().unwrap()).collect()
    }

    #[test]
    fn a_form_is_model_colon_names_or_names_alone() {
        let form: RequestLevelForm = "dlrm: cat_0, cat_1 ,dense".parse().unwrap();
        assert_eq!(form.model.as_deref(), Some("dlrm"));
        assert_eq!(form.names, ["cat_0", "cat_1", "dense"]);
        assert_eq!(form.to_string(), "dlrm:cat_0,cat_1,dense");
        let bare: RequestLevelForm = "cat_0,dense".parse().unwrap();
        assert_eq!((bare.model, bare.names), (None, vec!["cat_0".to_string(), "dense".to_string()]));
        let none: RequestLevelForm = "other:none".parse().unwrap();
        assert_eq!(none.names, ["none"]);
        let err = ":cat_0".parse::<RequestLevelForm>().unwrap_err();
        assert!(err.contains("no model before `:`"), "{err}");
        let err = "dlrm:".parse::<RequestLevelForm>().unwrap_err();
        assert!(err.contains("no feature names") && err.contains("none"), "{err}");
    }

    #[test]
    fn a_repository_takes_one_form_per_model_and_refuses_a_bare_one() {
        let by_model = per_model(&forms(&["dlrm:cat_0,dense", "other:none"])).unwrap();
        assert_eq!(by_model["dlrm"], ["cat_0", "dense"]);
        assert_eq!(by_model["other"], ["none"]);
        assert!(per_model(&[]).unwrap().is_empty(), "no form: every model keeps its own");
        let err = per_model(&forms(&["dlrm:cat_0", "cat_1,dense"])).unwrap_err();
        assert!(
            err.contains("--request-level cat_1,dense names no model") && err.contains("MODEL:cat_1,dense"),
            "{err}"
        );
        let err = per_model(&forms(&["dlrm:cat_0", "dlrm:cat_1"])).unwrap_err();
        assert!(err.contains("model dlrm twice (dlrm:cat_0 and dlrm:cat_1)"), "{err}");
    }

    #[test]
    fn a_single_model_server_takes_a_bare_form_or_its_own_models_form() {
        assert_eq!(for_single_model(&[], "dlrm").unwrap(), None);
        let bare = for_single_model(&forms(&["cat_0,dense"]), "dlrm").unwrap();
        assert_eq!(bare.unwrap(), ["cat_0", "dense"]);
        let named = for_single_model(&forms(&["dlrm:none"]), "dlrm").unwrap();
        assert_eq!(named.unwrap(), ["none"]);
        let err = for_single_model(&forms(&["other:cat_0"]), "dlrm").unwrap_err();
        assert!(err.contains("is for model other") && err.contains("serves one model, dlrm"), "{err}");
        let err = for_single_model(&forms(&["cat_0", "dlrm:cat_1"]), "dlrm").unwrap_err();
        assert!(err.contains("twice"), "{err}");
        let err = for_single_model(&forms(&["cat_0", "cat_1"]), "dlrm").unwrap_err();
        assert!(err.contains("twice"), "{err}");
    }
}
