// Command idempotency lets an operator look into an idempotency store and
// end records by hand: what did we answer for this key, which records are
// stuck in flight or abandoned, and settle, release or forget one of them.
//
//	go run ./cmd/idempotency -redis redis://127.0.0.1:6379 list
//	go run ./cmd/idempotency -postgres "$DSN" inspect acct_42 k1
//	go install ./cmd/idempotency
//
// Actions go through the same store calls as an owner's and are fenced the
// same way: one on a record that changed since it was read is refused, and
// one on a record whose owner's lease is live needs -force. Every action
// asks for confirmation unless -yes is given.
//
// idempotency proxy serves a reverse proxy that guards a service not
// written in Go with the library's middleware (docs/proxy.md):
//
//	idempotency -redis redis://127.0.0.1:6379 proxy -upstream http://127.0.0.1:3000 -scope-header X-Account-ID
package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/idempotency-go/idempotency"
)

const usage = `usage: idempotency [flags] COMMAND [ARGS]

Commands:
  inspect SCOPE KEY   show one record: state, attempt, token, lease, expiry,
                      operation ID, fingerprint, the steps it recorded, stored
                      status, header names and body size (never the body or
                      a step's result)
  list                the records in flight, abandoned ones first
                      (-limit, -after for the next page)
  stats               how many records are in flight and abandoned
  settle SCOPE KEY    store the outcome -status, -header, -body as the
                      record's, for its retries to replay
  release SCOPE KEY   let the next retry run the operation
  forget SCOPE KEY    make the key new again, erasing the operation: its ID,
                      attempts and recorded steps (needs -force)
  proxy [FLAGS]       serve a reverse proxy that guards an upstream service
                      not written in Go (idempotency proxy -h)

SCOPE is the key's scope (an account, a tenant), "" for a single tenant.

Flags:
`

// config is what the flags say.
type config struct {
	store            storeConfig
	json, yes, force bool
	limit            int
	after            string
	status           int
	headers          headerFlags
	body             string
	lease, retention time.Duration
	timeout          time.Duration
}

func main() {
	oneProc(os.Getenv)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run runs the command that args spell, and returns its exit code: 0 done,
// 1 failed, 2 misused.
func run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	var c config
	fs := flag.NewFlagSet("idempotency", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage); fs.PrintDefaults() }
	c.store.flags(fs)
	fs.BoolVar(&c.json, "json", false, "print JSON, one object per record, for scripts")
	fs.BoolVar(&c.yes, "yes", false, "act without asking for confirmation")
	fs.BoolVar(&c.force, "force", false, "act on a record whose owner holds a live lease, ending it; forget needs it always")
	fs.IntVar(&c.limit, "limit", 50, "list: the most records on a page")
	fs.StringVar(&c.after, "after", "", "list: the `CURSOR` a previous page printed")
	fs.IntVar(&c.status, "status", 0, "settle: the outcome's HTTP `STATUS`")
	fs.Var(&c.headers, "header", "settle: an outcome header, `NAME: VALUE` (repeatable)")
	fs.StringVar(&c.body, "body", "", "settle: the outcome's body")
	fs.DurationVar(&c.lease, "lease", 10*time.Second, "the lease an action holds the record under while it acts")
	fs.DurationVar(&c.retention, "retention", 24*time.Hour, "how long a settled outcome is kept: the service's Options.Retention")
	fs.DurationVar(&c.timeout, "timeout", 30*time.Second, "how long the command may take")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return 2
	}
	if fs.Arg(0) == "proxy" {
		// A service, not a command: no -timeout, and the store flags may
		// come from the environment too.
		if err := fromEnv(fs, os.Getenv); err != nil {
			fmt.Fprintln(stderr, "idempotency:", err)
			return 2
		}
		return runProxy(ctx, c.store, fs.Args()[1:], stdout, stderr)
	}
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	cmd, rest := fs.Arg(0), fs.Args()[1:]
	err := c.dispatch(ctx, cmd, rest, bufio.NewReader(stdin), stdout, stderr)
	var misuse usageError
	switch {
	case errors.As(err, &misuse):
		fmt.Fprintln(stderr, "idempotency:", err)
		return 2
	case err != nil:
		fmt.Fprintln(stderr, "idempotency:", err)
		return 1
	}
	return 0
}

// usageError is a command line that does not say what to do.
type usageError struct{ msg string }

func (e usageError) Error() string { return e.msg }

func (c *config) dispatch(ctx context.Context, cmd string, args []string, in *bufio.Reader, out, errOut io.Writer) error {
	var action idempotency.OperatorAction
	switch cmd {
	case "inspect", "settle", "release", "forget":
		if len(args) != 2 {
			return usageError{fmt.Sprintf("%s takes SCOPE and KEY, got %d arguments", cmd, len(args))}
		}
	case "list", "stats":
		if len(args) != 0 {
			return usageError{fmt.Sprintf("%s takes no arguments, got %q", cmd, args)}
		}
	default:
		return usageError{fmt.Sprintf("unknown command %q (inspect, list, stats, settle, release, forget, proxy)", cmd)}
	}
	switch cmd {
	case "settle":
		if c.status < 100 || c.status > 599 {
			return usageError{"settle needs -status, an HTTP status from 100 to 599"}
		}
		action = idempotency.OperatorAction{Disposition: idempotency.Keep,
			Response: idempotency.Response{Status: c.status, Header: http.Header(c.headers), Body: []byte(c.body)}}
	case "release":
		action.Disposition = idempotency.Release
	case "forget":
		action.Disposition = idempotency.Forget
	}
	var k idempotency.Key
	if len(args) == 2 {
		k = idempotency.Key{Scope: args[0], Name: args[1]}
		if err := k.Validate(); err != nil {
			return usageError{fmt.Sprintf("key %q: %v", args[1], err)}
		}
	}
	s, closeStore, err := c.store.open(ctx)
	if err != nil {
		return err
	}
	defer closeStore()
	p := printer{out: out, json: c.json}
	switch cmd {
	case "inspect":
		r, err := s.inspector.Inspect(ctx, k)
		if err != nil {
			return err
		}
		return p.record(r)
	case "list":
		recs, next, err := s.inspector.ListInFlight(ctx, c.after, c.limit)
		if err != nil {
			return err
		}
		return p.list(recs, next)
	case "stats":
		st, err := s.stats(ctx)
		if err != nil {
			return err
		}
		return p.stats(st)
	}
	return c.act(ctx, s, k, action, cmd, p, in, errOut)
}

// act inspects k's record, shows it, asks for confirmation, and acts.
func (c *config) act(ctx context.Context, s opened, k idempotency.Key, a idempotency.OperatorAction, cmd string, p printer, in *bufio.Reader, errOut io.Writer) error {
	seen, err := s.inspector.Inspect(ctx, k)
	if err != nil {
		return err
	}
	a.Force = c.force
	if a.Disposition == idempotency.Forget && !c.force {
		return errors.New(erases(seen))
	}
	if !c.yes {
		if err := (printer{out: errOut}).record(seen); err != nil {
			return err
		}
		fmt.Fprintf(errOut, "%s this record? Type yes to go on: ", cmd)
		answer, _ := in.ReadString('\n')
		if strings.TrimSpace(answer) != "yes" {
			return errors.New("not confirmed: nothing changed")
		}
	}
	g := idempotency.New(s.store, idempotency.Options{Lease: c.lease, Retention: c.retention})
	if err := g.Act(ctx, seen, a); err != nil {
		if errors.Is(err, idempotency.ErrLiveOwner) {
			return fmt.Errorf("%w: its lease has %v left; wait for it to run out, or act with -force", err, seen.LeaseLeft.Round(time.Millisecond))
		}
		return err
	}
	after, err := s.inspector.Inspect(ctx, k)
	if errors.Is(err, idempotency.ErrNoRecord) {
		return p.message(fmt.Sprintf("%s %q: done; no record of the key now", cmd, k.Name))
	}
	if err != nil {
		return err
	}
	return p.record(after)
}

// erases says what forgetting r would erase. Every record an operator can
// act on had an attempt that may have acted, so forget always needs -force.
func erases(r idempotency.Record) string {
	steps := "no recorded steps"
	if len(r.Steps) > 0 {
		steps = fmt.Sprintf("its recorded steps (%s)", strings.Join(r.Steps, ", "))
	}
	return fmt.Sprintf("forget erases operation %s: its %d attempt(s) and %s; the next request with the key "+
		"runs as a new operation, under new downstream keys, and may repeat what the operation did. "+
		"release lets the next retry resume the operation instead; forget with -force to erase it",
		r.OperationID, r.Attempt, steps)
}

// headerFlags collects -header NAME: VALUE.
type headerFlags http.Header

func (h *headerFlags) String() string { return "" }

func (h *headerFlags) Set(v string) error {
	name, value, ok := strings.Cut(v, ":")
	if !ok || strings.TrimSpace(name) == "" {
		return fmt.Errorf("want NAME: VALUE, got %q", v)
	}
	if *h == nil {
		*h = headerFlags{}
	}
	http.Header(*h).Add(strings.TrimSpace(name), strings.TrimSpace(value))
	return nil
}
