package main

import (
	"context"
	"fmt"
	"log"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	idempotencyotel "github.com/idempotency-go/idempotency/otel"
)

// metrics is the service's OpenTelemetry metrics, exported in the
// Prometheus format by handler on GET /metrics. Everything is read at
// scrape time; nothing is pushed.
type metrics struct {
	observer *idempotencyotel.Observer // the Guard's Options.Observer
	handler  http.Handler              // GET /metrics
	provider *sdkmetric.MeterProvider
}

// newMetrics makes a MeterProvider whose only reader is a Prometheus
// exporter on a registry of its own (not the global default one), the
// idempotency Observer on it, and the gauges of the store's Stats:
//
//	idempotency.store.records{idempotency.record.state="in_flight"|"abandoned"}
//
// read from the store on each scrape.
func newMetrics(store idempotencyotel.StatsReader) (*metrics, error) {
	reg := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	m := &metrics{
		provider: mp,
		handler:  promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorLog: log.Default()}),
	}
	fail := func(err error) (*metrics, error) {
		_ = mp.Shutdown(context.Background())
		return nil, err
	}
	if m.observer, err = idempotencyotel.NewObserver(idempotencyotel.Options{MeterProvider: mp}); err != nil {
		return fail(fmt.Errorf("idempotency observer: %w", err))
	}
	m.observer.TrackStore(store)
	return m, nil
}

// shutdown stops the MeterProvider; a scrape after it gets no metrics.
func (m *metrics) shutdown() {
	_ = m.provider.Shutdown(context.Background())
}
