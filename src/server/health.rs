//! What the server says about its health: grpc.health's overall status
//! (under `""` and every protocol's service name) and each model's under its
//! name, and the overall status for `/healthz`.
//!
//! Overall SERVING while every model that should serve has a warm, healthy
//! version (and at least one does); it follows every change of the models
//! until the drain begins, and from then on is NOT_SERVING for good: a
//! model recovering during the drain cannot turn the server SERVING again.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

use crate::lifecycle::ModelRegistry;

/// grpc.health's reporter and the overall status; cheap to clone.
#[derive(Clone)]
pub struct Health {
    reporter: HealthReporter,
    /// The service names the overall status is reported under.
    services: Arc<[&'static str]>,
    serving: Arc<AtomicBool>,
    /// Set once draining begins; every report holds it, so no report can
    /// land after the drain's.
    draining: Arc<tokio::sync::Mutex<bool>>,
}

fn status(serving: bool) -> ServingStatus {
    if serving {
        ServingStatus::Serving
    } else {
        ServingStatus::NotServing
    }
}

impl Health {
    /// NOT_SERVING under `""` and each of `services` until told otherwise.
    pub async fn new(reporter: HealthReporter, services: &[&'static str]) -> Self {
        let health = Self {
            reporter,
            services: services.into(),
            serving: Arc::new(AtomicBool::new(false)),
            draining: Arc::default(),
        };
        health.set(false).await;
        health
    }

    /// Whether the server as a whole is SERVING (for `/healthz`).
    pub fn serving(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.serving)
    }

    async fn set(&self, serving: bool) {
        self.serving.store(serving, Ordering::Relaxed);
        self.reporter.set_service_status("", status(serving)).await;
        for service in self.services.iter() {
            self.reporter.set_service_status(*service, status(serving)).await;
        }
    }

    /// Follows the models' health until the drain begins (a task).
    pub fn follow(&self, models: Arc<ModelRegistry>) -> tokio::task::JoinHandle<()> {
        let health = self.clone();
        tokio::spawn(async move {
            let mut changed = models.subscribe();
            let mut reported = BTreeSet::new();
            let mut was_serving = None;
            loop {
                changed.borrow_and_update();
                let (overall, each) = models.health();
                {
                    let draining = health.draining.lock().await;
                    if *draining {
                        return;
                    }
                    if was_serving != Some(overall) {
                        if overall {
                            tracing::info!("every model has a warm version; SERVING");
                        }
                        health.set(overall).await;
                        was_serving = Some(overall);
                    }
                    let now: BTreeSet<String> = each.iter().map(|(model, _)| model.clone()).collect();
                    for gone in reported.difference(&now) {
                        health.reporter.set_service_status(gone, ServingStatus::NotServing).await;
                    }
                    for (model, serving) in each {
                        health.reporter.set_service_status(&model, status(serving)).await;
                    }
                    reported = now;
                }
                if changed.changed().await.is_err() {
                    return;
                }
            }
        })
    }

    /// NOT_SERVING for good, overall and for every model of `models`.
    pub async fn drain(&self, models: &ModelRegistry) {
        let mut draining = self.draining.lock().await;
        *draining = true;
        self.set(false).await;
        for (model, _) in models.health().1 {
            self.reporter.set_service_status(&model, ServingStatus::NotServing).await;
        }
    }
}
