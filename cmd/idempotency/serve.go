package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"

	"github.com/idempotency-go/idempotency"
	idempotencyotel "github.com/idempotency-go/idempotency/otel"
)

// serve runs the proxy until ctx is done, then shuts it down gracefully.
// It prints the addresses it serves on to stdout once it does.
func (c *proxyConfig) serve(ctx context.Context, sc storeConfig, log *slog.Logger, stdout io.Writer) error {
	target, err := c.upstreamURL()
	if err != nil {
		return err
	}
	mo, err := c.middleware()
	if err != nil {
		return err
	}
	openCtx, cancel := context.WithTimeout(ctx, time.Minute)
	s, closeStore, err := sc.openToServe(openCtx, c.allowEviction)
	cancel()
	if err != nil {
		return err
	}
	defer closeStore()
	m, err := newMetrics(s.stats)
	if err != nil {
		return err
	}
	defer m.shutdown()
	g := idempotency.New(s.store, idempotency.Options{Lease: c.lease, Retention: c.retention,
		OperationTimeout: c.operationTimeout, WaitTimeout: c.waitTimeout, ClaimTimeout: c.claimTimeout,
		Observer: m.observer})
	untrack := m.observer.Track(g)
	defer untrack()

	clients, admin, err := c.listenBoth()
	if err != nil {
		return err
	}
	up := upstreamOptions{target: target, trustForwarded: c.trustForwarded, keyHeader: idempotency.HeaderKey,
		protected: protectedHeaders(idempotency.HeaderKey, c.scopeHeader, mo.FingerprintHeaders),
		transport: newTransport(), log: log}
	front := &http.Server{Handler: g.Middleware(mo)(upstreamHandler(up)),
		ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	servers := []*http.Server{front}
	listeners := []net.Listener{clients}
	if admin != nil {
		servers = append(servers, &http.Server{Handler: adminHandler(s, m.handler), ReadHeaderTimeout: 10 * time.Second})
		listeners = append(listeners, admin)
	}
	fmt.Fprintf(stdout, "idempotency proxy: serving %s for %s", clients.Addr(), target)
	if admin != nil {
		fmt.Fprintf(stdout, ", /healthz and /metrics on %s", admin.Addr())
	}
	fmt.Fprintln(stdout)
	log.Info("serving", "listen", clients.Addr().String(), "upstream", target.String())
	return c.run(ctx, s, servers, listeners, log)
}

// run serves on each listener with its server until ctx is done, deleting
// expired records on schedule, then shuts every server down, letting the
// requests under way finish for up to -shutdown-timeout.
func (c *proxyConfig) run(ctx context.Context, s opened, servers []*http.Server, listeners []net.Listener, log *slog.Logger) error {
	failed := make(chan error, len(servers))
	for i, srv := range servers {
		go func() {
			if err := srv.Serve(listeners[i]); !errors.Is(err, http.ErrServerClosed) {
				failed <- err
			}
		}()
	}
	if s.deleteExpired != nil && c.deleteExpiredEvery > 0 {
		go deleteExpired(ctx, s.deleteExpired, c.deleteExpiredEvery, log)
	}
	var err error
	select {
	case <-ctx.Done():
	case err = <-failed:
	}
	log.Info("shutting down: finishing the requests under way", "for at most", c.shutdownTimeout)
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.shutdownTimeout)
	defer cancel()
	for _, srv := range servers {
		err = errors.Join(err, srv.Shutdown(sctx))
	}
	return err
}

// deleteExpired runs del every interval until ctx is done.
func deleteExpired(ctx context.Context, del func(context.Context) (int64, error), every time.Duration, log *slog.Logger) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		n, err := del(ctx)
		if err != nil {
			log.Warn("deleting expired records", "err", err)
			continue
		}
		log.Debug("deleted expired records", "records", n)
	}
}

// adminHandler serves GET /healthz, 200 once the store answered within a
// second and 503 otherwise, and GET /metrics.
func adminHandler(s opened, metrics http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", metrics)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), time.Second)
		defer cancel()
		if _, err := s.stats(ctx); err != nil {
			http.Error(w, "store: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// metrics is the proxy's OpenTelemetry metrics, exported in the Prometheus
// format on GET /metrics: the metrics the library's alerts and dashboard
// read (monitoring/), the store's records in flight among them.
type metrics struct {
	observer *idempotencyotel.Observer
	handler  http.Handler
	provider *sdkmetric.MeterProvider
}

func newMetrics(stats func(context.Context) (idempotency.Stats, error)) (*metrics, error) {
	reg := prometheus.NewRegistry()
	exporter, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		return nil, fmt.Errorf("prometheus exporter: %w", err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exporter))
	o, err := idempotencyotel.NewObserver(idempotencyotel.Options{MeterProvider: mp})
	if err != nil {
		_ = mp.Shutdown(context.Background())
		return nil, fmt.Errorf("idempotency observer: %w", err)
	}
	o.TrackStore(statsFunc(stats))
	return &metrics{observer: o, provider: mp, handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{})}, nil
}

func (m *metrics) shutdown() { _ = m.provider.Shutdown(context.Background()) }

// statsFunc is a function as an idempotencyotel.StatsReader.
type statsFunc func(context.Context) (idempotency.Stats, error)

func (f statsFunc) Stats(ctx context.Context) (idempotency.Stats, error) { return f(ctx) }
