package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/signal"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/idempotency-go/idempotency"
)

const proxyUsage = `usage: idempotency [store flags] proxy [flags]

Runs a reverse proxy that guards every request of the -methods (POST and
PATCH by default) to -upstream with an Idempotency-Key, on the store the
store flags name, with the contract of the library's middleware: a retry
replays the stored answer, a concurrent duplicate waits for it, a key
reused with another request gets 422, and an answer is stored before it
is sent. The upstream gets, on every guarded request, the headers
Idempotency-Operation-Key (the same for every attempt at one operation),
Idempotency-Fencing-Token (greater at every attempt) and
Idempotency-Attempt, so that it can de-duplicate its own side effects and
refuse a stale attempt's writes (docs/proxy.md).

Every flag, store flags included, can also be set by the environment
variable IDEMPOTENCY_ and its name in capitals, - as _ (IDEMPOTENCY_UPSTREAM,
IDEMPOTENCY_SCOPE_HEADER, IDEMPOTENCY_REDIS, ...); a flag given on the
command line wins. On SIGINT or SIGTERM its /readyz fails for
-drain-delay while it still serves, then it stops taking requests and
finishes those under way, for at most -shutdown-timeout; a second signal
stops it at once. It runs Go code on one OS thread at a time, for latency
(docs/proxy.md, "Added latency"), unless the environment variable
GOMAXPROCS sets another number.

Flags:
`

// proxyConfig is what the proxy's flags say.
type proxyConfig struct {
	upstream, listen, adminListen string
	scopeHeader                   string
	singleTenant, optionalKey     bool
	trustForwarded                bool
	methods, fingerprintHeaders   string
	errors                        string
	lease, retention              time.Duration
	operationTimeout, waitTimeout time.Duration
	claimTimeout, shutdownTimeout time.Duration
	deleteExpiredEvery            time.Duration
	maxRequestBytes               int64
	maxResponseBytes              int64
	allowEviction                 bool
	keyHeader, keepStatus         string
	readTimeout, writeTimeout     time.Duration
	idleTimeout, drainDelay       time.Duration
	accessLog                     bool
	tlsCert, tlsKey               string
	upstreamCA                    string
	upstreamCert, upstreamKey     string
}

func (c *proxyConfig) flags(fs *flag.FlagSet) {
	fs.StringVar(&c.upstream, "upstream", "", "the service to proxy to, `URL` http://host:port[/path] (required)")
	fs.StringVar(&c.listen, "listen", ":8080", "the `ADDR` to serve clients on")
	fs.StringVar(&c.adminListen, "admin-listen", "127.0.0.1:9090", "the `ADDR` to serve /healthz (liveness), /readyz (readiness) and /metrics on; empty for none")
	fs.StringVar(&c.scopeHeader, "scope-header", "", "the request header that names the account a key belongs to, e.g. X-Account-ID; a guarded request without it gets 400 (required unless -single-tenant)")
	fs.BoolVar(&c.singleTenant, "single-tenant", false, "the API has one tenant: every key is in one scope")
	fs.StringVar(&c.methods, "methods", "POST,PATCH", "the `METHODS` guarded, comma-separated, in any case; others pass through unguarded")
	fs.BoolVar(&c.optionalKey, "optional-key", false, "pass a guarded request without Idempotency-Key through unguarded, instead of answering 400")
	fs.StringVar(&c.fingerprintHeaders, "fingerprint-headers", "", "request `HEADERS` that count in the fingerprint besides the method, path, query and body, comma-separated")
	fs.StringVar(&c.errors, "errors", "problem", "how errors are answered: problem (RFC 9457 problem details) or stripe (Stripe's error shape)")
	fs.DurationVar(&c.lease, "lease", 10*time.Second, "how long an attempt holds a key before it must renew it")
	fs.DurationVar(&c.retention, "retention", 24*time.Hour, "how long an answer is kept for its retries")
	fs.DurationVar(&c.operationTimeout, "operation-timeout", time.Minute, "how long the upstream may take on one attempt; then it is cancelled, 504 answered and the key released")
	fs.DurationVar(&c.waitTimeout, "wait-timeout", 0, "how long a duplicate waits for the attempt in flight before 409 (default: the library's)")
	fs.DurationVar(&c.claimTimeout, "claim-timeout", 0, "how long a claim may wait for the store before 503 (default: the library's)")
	fs.DurationVar(&c.shutdownTimeout, "shutdown-timeout", 75*time.Second, "how long a shutdown waits for the requests under way")
	fs.DurationVar(&c.deleteExpiredEvery, "delete-expired-every", 5*time.Minute, "PostgreSQL: how often to delete the records whose retention ran out; 0 for never")
	fs.Int64Var(&c.maxRequestBytes, "max-request-bytes", 0, "the largest guarded request body, in `BYTES`; larger gets 413 (default: the library's, 1 MiB)")
	fs.Int64Var(&c.maxResponseBytes, "max-response-bytes", 0, "the largest answer kept whole, in `BYTES`; a larger one is stored without its body and streamed (default: the library's, 1 MiB)")
	fs.BoolVar(&c.trustForwarded, "trust-forwarded", false, "pass on the forwarding headers (X-Forwarded-Proto, -Host, -For...) the client sends, adding to X-Forwarded-For: for a proxy behind a gateway that sets them; otherwise they are replaced by the proxy's own view")
	fs.BoolVar(&c.allowEviction, "allow-eviction", false, "Redis: serve on a server that may evict records (a second execution once one is evicted)")
	c.moreFlags(fs)
}

func (c *proxyConfig) moreFlags(fs *flag.FlagSet) {
	fs.StringVar(&c.keyHeader, "key-header", idempotency.HeaderKey, "the request `HEADER` that carries the idempotency key, e.g. X-Idempotency-Key; the upstream gets it under this name")
	fs.StringVar(&c.keepStatus, "keep-status", "", "upstream `STATUSES` (comma-separated, e.g. 500,504) stored and replayed instead of releasing the key, for an upstream that cannot de-duplicate")
	fs.DurationVar(&c.readTimeout, "read-timeout", 30*time.Second, "how long a client may take to send a whole request, body included")
	fs.DurationVar(&c.writeTimeout, "write-timeout", 0, "how long the proxy may take to answer a request, from the end of its header, before the connection is closed (default: -operation-timeout plus 1m)")
	fs.DurationVar(&c.idleTimeout, "idle-timeout", 2*time.Minute, "how long an idle keep-alive connection from a client stays open")
	fs.DurationVar(&c.drainDelay, "drain-delay", 0, "on SIGTERM, how long /readyz fails while requests are still served, before the listener closes")
	fs.BoolVar(&c.accessLog, "access-log", false, "write one JSON line per request to stdout: method, path, status, outcome, attempt, duration, a hash of the key, request id")
	fs.StringVar(&c.tlsCert, "tls-cert", "", "serve clients over TLS with this certificate `FILE` (PEM; with -tls-key)")
	fs.StringVar(&c.tlsKey, "tls-key", "", "the private key `FILE` of -tls-cert (PEM)")
	fs.StringVar(&c.upstreamCA, "upstream-ca", "", "an https upstream: trust the CA certificates in this PEM `FILE` instead of the system's")
	fs.StringVar(&c.upstreamCert, "upstream-cert", "", "an https upstream: present this client certificate `FILE` (PEM; with -upstream-key)")
	fs.StringVar(&c.upstreamKey, "upstream-key", "", "the private key `FILE` of -upstream-cert (PEM)")
}

// fromEnv sets every flag of fs not given on the command line from its
// environment variable, if set.
func fromEnv(fs *flag.FlagSet, getenv func(string) string) error {
	given := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { given[f.Name] = true })
	var errs []error
	fs.VisitAll(func(f *flag.Flag) {
		name := "IDEMPOTENCY_" + strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_"))
		if v := getenv(name); v != "" && !given[f.Name] {
			if err := fs.Set(f.Name, v); err != nil {
				errs = append(errs, fmt.Errorf("%s: %w", name, err))
			}
		}
	})
	return errors.Join(errs...)
}

// runProxy parses the proxy's flags from args and serves until ctx is done.
func runProxy(ctx context.Context, store storeConfig, args []string, stdout, stderr io.Writer) int {
	var c proxyConfig
	fs := flag.NewFlagSet("idempotency proxy", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, proxyUsage); fs.PrintDefaults() }
	c.flags(fs)
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if err := fromEnv(fs, os.Getenv); err != nil {
		fmt.Fprintln(stderr, "idempotency proxy:", err)
		return 2
	}
	log := slog.New(slog.NewTextHandler(stderr, nil))
	hurry, stopSignals := secondSignal()
	defer stopSignals()
	err := c.serve(ctx, store, log, stdout, hurry)
	var misuse usageError
	switch {
	case errors.As(err, &misuse):
		fmt.Fprintln(stderr, "idempotency proxy:", err)
		return 2
	case err != nil:
		log.Error("proxy stopped", "err", err)
		return 1
	}
	return 0
}

// oneProc runs the process's Go code on one OS thread at a time
// (GOMAXPROCS 1), unless the GOMAXPROCS environment variable sets the
// number. main calls it, so that a test running the proxy inside its own
// process keeps its own.
//
// Why: a proxy's requests spend their time waiting on the network (the
// client, the store twice, the upstream), and a new operation passes from
// goroutine to goroutine about eleven times (the connection's goroutine,
// the Transport's read and write loops, each reply from Redis). With more
// than one thread, each hand-off wakes a parked thread on another CPU,
// which the kernel (on a virtual machine, the hypervisor) must wake first:
// on a 2-CPU VM, one thread took the p50 a new operation adds from 0.65 to
// 0.47 ms (docs/proxy.md, "Added latency"). One thread still served about
// 4,100 new operations a second there; a proxy that must serve more, on
// more CPUs, sets GOMAXPROCS. The operator's commands, one store call after
// another, need no more either.
func oneProc(getenv func(string) string) {
	if getenv("GOMAXPROCS") == "" {
		runtime.GOMAXPROCS(1)
	}
}

// secondSignal returns a channel closed once the process got SIGINT or
// SIGTERM twice: the first stops the proxy gracefully (through the
// context main gives run), the second at once. stop ends the watch.
func secondSignal() (hurry <-chan struct{}, stop func()) {
	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	done, twice := make(chan struct{}), make(chan struct{})
	go func() {
		for n := 0; n < 2; n++ {
			select {
			case <-sigs:
			case <-done:
				return
			}
		}
		close(twice)
	}()
	return twice, func() { signal.Stop(sigs); close(done) }
}

// middleware is the middleware's options the flags say.
func (c *proxyConfig) middleware() (idempotency.MiddlewareOptions, error) {
	methods, err := parseMethods(c.methods)
	if err != nil {
		return idempotency.MiddlewareOptions{}, err
	}
	keep, err := parseStatuses(c.keepStatus)
	if err != nil {
		return idempotency.MiddlewareOptions{}, err
	}
	if !validHeaderName(c.keyHeader) {
		return idempotency.MiddlewareOptions{}, usageError{fmt.Sprintf("-key-header %q: want a header name", c.keyHeader)}
	}
	o := idempotency.MiddlewareOptions{
		Methods:            methods,
		OptionalKey:        c.optionalKey,
		MaxRequestBytes:    c.maxRequestBytes,
		MaxResponseBytes:   c.maxResponseBytes,
		FingerprintHeaders: splitList(c.fingerprintHeaders),
		Disposition:        keepOr(keep, idempotency.DefaultDisposition),
	}
	switch {
	case c.singleTenant && c.scopeHeader != "":
		return o, usageError{"-scope-header and -single-tenant say two things: give one"}
	case c.singleTenant:
		o.Scope = idempotency.SingleTenant
	case c.scopeHeader != "":
		o.Scope = headerScope(http.CanonicalHeaderKey(c.scopeHeader))
	default:
		return o, usageError{"-scope-header is required, so that two accounts never share a key; an API with one tenant says -single-tenant"}
	}
	switch c.errors {
	case "problem":
	case "stripe":
		o.Errors = idempotency.StripeErrors
	default:
		return o, usageError{fmt.Sprintf("-errors %q: want problem or stripe", c.errors)}
	}
	return o, nil
}

// knownMethods are the methods -methods may name: those of RFC 9110 and
// PATCH (RFC 5789).
var knownMethods = []string{http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut,
	http.MethodPatch, http.MethodDelete, http.MethodConnect, http.MethodOptions, http.MethodTrace}

// parseMethods reads -methods: method names in any case, as the upper-case
// tokens a request line carries (the middleware compares them exactly).
// An unknown name is refused rather than guarding nothing.
func parseMethods(s string) ([]string, error) {
	var out []string
	for _, m := range splitList(s) {
		up := strings.ToUpper(m)
		if !slices.Contains(knownMethods, up) {
			return nil, usageError{fmt.Sprintf("-methods: unknown method %q: want some of %s", m, strings.Join(knownMethods, ","))}
		}
		if !slices.Contains(out, up) {
			out = append(out, up)
		}
	}
	if len(out) == 0 {
		return nil, usageError{"-methods names no method"}
	}
	return out, nil
}

// parseStatuses reads -keep-status: HTTP statuses, comma-separated.
func parseStatuses(s string) (map[int]bool, error) {
	keep := map[int]bool{}
	for _, f := range splitList(s) {
		n, err := strconv.Atoi(f)
		if err != nil || n < 100 || n > 599 {
			return nil, usageError{fmt.Sprintf("-keep-status: %q is no HTTP status", f)}
		}
		keep[n] = true
	}
	return keep, nil
}

// keepOr is the disposition that keeps (stores and replays) an answer
// whose status is in keep, and otherwise decides as def.
func keepOr(keep map[int]bool, def func(int) idempotency.Disposition) func(int) idempotency.Disposition {
	return func(status int) idempotency.Disposition {
		if keep[status] {
			return idempotency.Keep
		}
		return def(status)
	}
}

// validHeaderName reports whether name is a field name (an RFC 9110 token).
func validHeaderName(name string) bool {
	if name == "" {
		return false
	}
	for _, c := range []byte(name) {
		if c <= ' ' || c >= 0x7f || strings.IndexByte(`"(),/:;<=>?@[\]{}`, c) >= 0 {
			return false
		}
	}
	return true
}

// errNoScope answers a guarded request that does not name its account.
var errNoScope = errors.New("no account header")

// headerScope scopes a request's key by the value of header: a request
// without it is refused.
func headerScope(header string) func(*http.Request) (string, error) {
	return func(r *http.Request) (string, error) {
		v := r.Header.Values(header)
		if len(v) != 1 || v[0] == "" {
			return "", fmt.Errorf("%w %s (one value)", errNoScope, header)
		}
		return v[0], nil
	}
}

func splitList(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// upstreamTarget is -upstream, checked: the URL requests go to and, for
// unix:/path, the socket the connections are made on (the URL is then
// http://localhost).
func (c *proxyConfig) upstreamTarget() (target *url.URL, socket string, err error) {
	if c.upstream == "" {
		return nil, "", usageError{"-upstream is required"}
	}
	if path, ok := strings.CutPrefix(c.upstream, "unix:"); ok {
		if path == "" {
			return nil, "", usageError{fmt.Sprintf("-upstream %q: want unix:/path/to/socket", c.upstream)}
		}
		return &url.URL{Scheme: "http", Host: "localhost"}, path, nil
	}
	u, err := url.Parse(c.upstream)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, "", usageError{fmt.Sprintf("-upstream %q: want http://host:port, https://host:port or unix:/path", c.upstream)}
	}
	return u, "", nil
}

// listenBoth opens the clients' listener and, if asked for, the admin one.
func (c *proxyConfig) listenBoth() (clients, admin net.Listener, err error) {
	if clients, err = net.Listen("tcp", c.listen); err != nil {
		return nil, nil, err
	}
	if c.adminListen == "" {
		return clients, nil, nil
	}
	if admin, err = net.Listen("tcp", c.adminListen); err != nil {
		clients.Close()
		return nil, nil, err
	}
	return clients, admin, nil
}
