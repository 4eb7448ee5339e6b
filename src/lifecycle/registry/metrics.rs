//! The registry's own Prometheus metrics: version loads and states,
//! unrouted requests, the tables held, and refused control calls.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;

pub(super) type Labels = Vec<(String, String)>;

pub(super) struct RegistryMetrics {
    pub(super) registry: prometheus_client::registry::Registry,
    pub(super) loads: Family<Labels, Counter>,
    pub(super) versions: Family<Labels, Gauge>,
    pub(super) unrouted: Family<Labels, Counter>,
    pub(super) tables_held: Gauge,
    pub(super) table_bytes_held: Gauge,
    pub(super) control_unauthorized: Family<Labels, Counter>,
}

impl RegistryMetrics {
    pub(super) fn new() -> Self {
        let mut registry = prometheus_client::registry::Registry::with_prefix("narsil");
        let (loads, versions, unrouted) = (Family::default(), Family::default(), Family::default());
        registry.register("requests", "Requests by outcome", unrouted.clone());
        registry.register("model_loads", "Version loads by model and outcome (ok, failed)", loads.clone());
        registry.register("model_versions", "Versions of each model by state", versions.clone());
        let (tables_held, table_bytes_held) = (Gauge::default(), Gauge::default());
        registry.register(
            "tables_held",
            "Embedding tables of split models held by the process (a table shared by versions counts once)",
            tables_held.clone(),
        );
        registry.register(
            "table_bytes_held",
            "Bytes of the embedding tables held by the process, in memory or mapped (shared tables once)",
            table_bytes_held.clone(),
        );
        let control_unauthorized = Family::default();
        registry.register(
            "control_unauthorized",
            "Model-control calls refused for their token, by reason (missing, wrong)",
            control_unauthorized.clone(),
        );
        Self { registry, loads, versions, unrouted, tables_held, table_bytes_held, control_unauthorized }
    }
}

pub(super) fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}
