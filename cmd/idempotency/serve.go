package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/idempotency-go/idempotency"
	idempotencyotel "github.com/idempotency-go/idempotency/otel"
)

// serve runs the proxy until ctx is done, then shuts it down gracefully,
// or at once when hurry is closed. It prints the addresses it serves on to
// stdout once it does, and the access log after them.
func (c *proxyConfig) serve(ctx context.Context, sc storeConfig, log *slog.Logger, stdout io.Writer, hurry <-chan struct{}) error {
	up, mo, err := c.prepare(log)
	if err != nil {
		return err
	}
	tlsConfig, err := c.listenerTLS()
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
	fr := front{keyHeader: up.keyHeader}
	var observer idempotency.Observer = m.observer
	if c.accessLog {
		fr.access = slog.New(slog.NewJSONHandler(stdout, nil))
		observer = accessObserver{m.observer}
	}
	g := idempotency.New(s.store, idempotency.Options{Lease: c.lease, Retention: c.retention,
		OperationTimeout: c.operationTimeout, WaitTimeout: c.waitTimeout, ClaimTimeout: c.claimTimeout,
		Observer: observer})
	untrack := m.observer.Track(g)
	defer untrack()
	ad := &admin{stats: s.stats, dial: up.dial, log: log}
	return c.listenAndRun(ctx, s, fr.handler(g.Middleware(mo)(upstreamHandler(up))), tlsConfig, ad, m.handler, stdout, hurry, log)
}

// prepare checks every flag that does not need the store, and makes the
// upstream's side of the proxy and the middleware's options.
func (c *proxyConfig) prepare(log *slog.Logger) (upstreamOptions, idempotency.MiddlewareOptions, error) {
	target, socket, err := c.upstreamTarget()
	if err != nil {
		return upstreamOptions{}, idempotency.MiddlewareOptions{}, err
	}
	mo, err := c.middleware()
	if err != nil {
		return upstreamOptions{}, mo, err
	}
	transport, err := newTransport(socket, c.upstreamCA, c.upstreamCert, c.upstreamKey)
	if err != nil {
		return upstreamOptions{}, mo, err
	}
	key := http.CanonicalHeaderKey(c.keyHeader)
	return upstreamOptions{target: target, trustForwarded: c.trustForwarded, keyHeader: key,
		protected: protectedHeaders(key, c.scopeHeader, mo.FingerprintHeaders),
		transport: transport, dial: upstreamDialer(target, socket), log: log}, mo, nil
}

// listenerTLS is the clients' listener's TLS configuration, nil for none.
func (c *proxyConfig) listenerTLS() (*tls.Config, error) {
	if (c.tlsCert == "") != (c.tlsKey == "") {
		return nil, usageError{"-tls-cert and -tls-key go together"}
	}
	if c.tlsCert == "" {
		return nil, nil
	}
	cert, err := tls.LoadX509KeyPair(c.tlsCert, c.tlsKey)
	if err != nil {
		return nil, fmt.Errorf("-tls-cert, -tls-key: %w", err)
	}
	return &tls.Config{MinVersion: tls.VersionTLS12, Certificates: []tls.Certificate{cert}}, nil
}

// listenAndRun opens the listeners, says where it serves, and serves
// clients with handler (over TLS with tlsConfig, unless nil) and the admin
// listener with ad, until ctx is done.
func (c *proxyConfig) listenAndRun(ctx context.Context, s opened, handler http.Handler, tlsConfig *tls.Config,
	ad *admin, metrics http.Handler, stdout io.Writer, hurry <-chan struct{}, log *slog.Logger) error {
	clients, adminL, err := c.listenBoth()
	if err != nil {
		return err
	}
	writeTimeout := c.writeTimeout
	if writeTimeout == 0 && c.operationTimeout > 0 {
		writeTimeout = c.operationTimeout + time.Minute
	}
	front := &http.Server{Handler: handler, TLSConfig: tlsConfig, ReadHeaderTimeout: 10 * time.Second,
		ReadTimeout: c.readTimeout, WriteTimeout: writeTimeout, IdleTimeout: c.idleTimeout,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	servers, listeners := []*http.Server{front}, []net.Listener{clients}
	if adminL != nil {
		servers = append(servers, &http.Server{Handler: ad.handler(metrics), ReadHeaderTimeout: 10 * time.Second,
			ReadTimeout: 10 * time.Second, WriteTimeout: time.Minute})
		listeners = append(listeners, adminL)
	}
	fmt.Fprintf(stdout, "idempotency proxy: serving %s for %s", clients.Addr(), c.upstream)
	if adminL != nil {
		fmt.Fprintf(stdout, ", /healthz and /metrics on %s", adminL.Addr())
	}
	fmt.Fprintln(stdout)
	log.Info("serving", "listen", clients.Addr().String(), "upstream", c.upstream, "tls", tlsConfig != nil)
	return c.run(ctx, s, servers, listeners, ad, hurry, log)
}

// errHurried ends a proxy stopped at once by a second signal.
var errHurried = errors.New("stopped at once on a second signal: requests under way were cut off")

// run serves on each listener with its server until ctx is done, deleting
// expired records on schedule. Then /readyz fails for -drain-delay while
// requests are still served, and every server shuts down, letting the
// requests under way finish for up to -shutdown-timeout. Once hurry is
// closed, every connection is closed at once.
func (c *proxyConfig) run(ctx context.Context, s opened, servers []*http.Server, listeners []net.Listener,
	ad *admin, hurry <-chan struct{}, log *slog.Logger) error {
	failed := make(chan error, len(servers))
	for i, srv := range servers {
		go func() {
			if err := serveOn(srv, listeners[i]); !errors.Is(err, http.ErrServerClosed) {
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
	ad.draining.Store(true)
	if err == nil && c.drainDelay > 0 {
		log.Info("draining: /readyz fails, requests are still served", "for", c.drainDelay)
		select {
		case <-time.After(c.drainDelay):
		case <-hurry:
			return closeAll(servers, errHurried)
		}
	}
	return errors.Join(err, c.shutdown(ctx, servers, hurry, log))
}

// serveOn serves srv on l, over TLS when srv has a TLS configuration.
func serveOn(srv *http.Server, l net.Listener) error {
	if srv.TLSConfig != nil {
		return srv.ServeTLS(l, "", "")
	}
	return srv.Serve(l)
}

// shutdown closes the listeners and waits for the requests under way, for
// at most -shutdown-timeout, or until hurry is closed.
func (c *proxyConfig) shutdown(ctx context.Context, servers []*http.Server, hurry <-chan struct{}, log *slog.Logger) error {
	log.Info("shutting down: finishing the requests under way", "for at most", c.shutdownTimeout)
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.shutdownTimeout)
	defer cancel()
	hurried := make(chan bool, 1)
	go func() {
		select {
		case <-hurry:
			hurried <- true
			cancel()
		case <-sctx.Done():
			hurried <- false
		}
	}()
	var err error
	for _, srv := range servers {
		err = errors.Join(err, srv.Shutdown(sctx))
	}
	cancel()
	if <-hurried {
		return closeAll(servers, errHurried)
	}
	return err
}

// closeAll closes every server's listeners and connections, and returns err.
func closeAll(servers []*http.Server, err error) error {
	for _, srv := range servers {
		_ = srv.Close()
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

// admin serves the admin listener: liveness, readiness and metrics.
type admin struct {
	stats func(context.Context) (idempotency.Stats, error)
	dial  func(context.Context) error // connects to the upstream, and closes
	// draining is set once the proxy stops: /readyz fails from then on.
	draining atomic.Bool
	log      *slog.Logger
}

// handler serves GET /healthz, 200 while the process serves (liveness);
// GET /readyz, 200 while it is not draining, the store answered within a
// second and the upstream took a connection within a second, 503 otherwise
// (readiness); and GET /metrics. Neither body carries an error's text,
// which goes to the log.
func (a *admin) handler(metrics http.Handler) http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", metrics)
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		if a.draining.Load() {
			http.Error(w, "draining", http.StatusServiceUnavailable)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), time.Second)
		defer cancel()
		if _, err := a.stats(ctx); err != nil {
			a.log.Warn("not ready: the store did not answer", "err", err)
			http.Error(w, "store unavailable", http.StatusServiceUnavailable)
			return
		}
		if err := a.dial(ctx); err != nil {
			a.log.Warn("not ready: the upstream took no connection", "err", err)
			http.Error(w, "upstream unreachable", http.StatusServiceUnavailable)
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
	// The proxy exports metrics, never spans: a no-op tracer spares each
	// call the spans the global tracer would make and drop.
	o, err := idempotencyotel.NewObserver(idempotencyotel.Options{MeterProvider: mp, TracerProvider: tracenoop.NewTracerProvider()})
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
