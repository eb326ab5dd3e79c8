package main

import (
	"context"
	"fmt"
	"log"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.opentelemetry.io/otel/attribute"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	"go.opentelemetry.io/otel/metric"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idempotency-go/idempotency"
	idempotencyotel "github.com/idempotency-go/idempotency/otel"
)

// statsReader is a store that counts its records in flight: the Redis store
// and the PostgreSQL store both are.
type statsReader interface {
	Stats(ctx context.Context) (idempotency.Stats, error)
}

// statsTimeout bounds each scrape's Stats call: a store that hangs leaves
// the gauge out of that scrape instead of holding the scrape up.
const statsTimeout = 5 * time.Second

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
func newMetrics(store statsReader) (*metrics, error) {
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
	if err := registerStoreStats(mp.Meter("github.com/idempotency-go/idempotency/examples/payments"), store); err != nil {
		return fail(fmt.Errorf("store gauges: %w", err))
	}
	return m, nil
}

// registerStoreStats adds idempotency.store.records, one observation per
// state, from store.Stats at each collection. A failed Stats leaves the
// series out of that scrape (the SDK logs the error), rather than reporting
// zero abandoned records that may well be there.
func registerStoreStats(meter metric.Meter, store statsReader) error {
	records, err := meter.Int64ObservableGauge("idempotency.store.records",
		metric.WithUnit("{record}"),
		metric.WithDescription("Records in flight in the idempotency store, by state: in_flight (the owner's lease is live) "+
			"or abandoned (the lease ran out unsettled; waiting for a retry or a sweep)."))
	if err != nil {
		return err
	}
	inFlight := metric.WithAttributeSet(attribute.NewSet(attribute.String("idempotency.record.state", "in_flight")))
	abandoned := metric.WithAttributeSet(attribute.NewSet(attribute.String("idempotency.record.state", "abandoned")))
	_, err = meter.RegisterCallback(func(ctx context.Context, o metric.Observer) error {
		ctx, cancel := context.WithTimeout(ctx, statsTimeout)
		defer cancel()
		st, err := store.Stats(ctx)
		if err != nil {
			return fmt.Errorf("store stats: %w", err)
		}
		o.ObserveInt64(records, st.InFlight, inFlight)
		o.ObserveInt64(records, st.Abandoned, abandoned)
		return nil
	}, records)
	return err
}

// shutdown stops the MeterProvider; a scrape after it gets no metrics.
func (m *metrics) shutdown() {
	_ = m.provider.Shutdown(context.Background())
}
