package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idempotency-go/idempotency"
)

const (
	// attemptTimeout bounds one HTTP attempt, as a client's timeout
	// would: a stopped instance holds its connections until then.
	attemptTimeout = 10 * time.Second
	// chargeDeadline bounds a logical charge, all its attempts included:
	// a charge unanswered by then counts as stranded.
	chargeDeadline = 60 * time.Second
	// resendAfter is how old an answer must be before a client sends its
	// key again.
	resendAfter = time.Second
)

// attempt is one HTTP attempt, as the balancer saw it.
type attempt struct {
	slot, gen int
	from      time.Time
	d         time.Duration
	status    int // 0: no response
	replayed  bool
	err       error
}

// outcome names how an attempt ended, for the tail's breakdown.
func (a attempt) outcome() string {
	switch {
	case errors.Is(a.err, context.DeadlineExceeded):
		return "attempt timed out"
	case a.err != nil:
		return "connection error"
	case a.status == http.StatusCreated && a.replayed:
		return "201 replayed"
	case a.status == http.StatusCreated:
		return "201 executed"
	}
	return fmt.Sprint(a.status)
}

// answer is a response read whole.
type answer struct {
	status   int
	header   http.Header
	body     []byte
	replayed bool
}

// same reports whether b is a's answer again: status, the stored headers
// the example sets, body.
func (a answer) same(b answer) bool {
	return a.status == b.status && bytes.Equal(a.body, b.body) &&
		a.header.Get("Content-Type") == b.header.Get("Content-Type") &&
		a.header.Get("Location") == b.header.Get("Location")
}

// sender is one client's logical request: one key sent, with retries, until
// it has a final answer.
type sender struct {
	key, account, body string
	amount             int64
	first              int  // the slot of the first attempt; -1: any
	duplicate          bool // a concurrent twin or a re-send of the key
	resend             bool // a re-send of a key answered before

	r        *rand.Rand // the balancer's choices, this sender's only
	from     time.Time
	d        time.Duration // to the final answer
	attempts []attempt
	final    answer
	err      error
}

type senderKey struct{}

// balancer is the Transport's Base: it sends each attempt to an instance
// picked at random, under attemptTimeout, reads the answer whole and
// records the attempt in the sender the request's context carries.
type balancer struct {
	svc  *service
	base http.RoundTripper
}

func (b *balancer) RoundTrip(req *http.Request) (*http.Response, error) {
	s := req.Context().Value(senderKey{}).(*sender)
	sl, base, gen := b.svc.pick(s.r)
	if len(s.attempts) == 0 && s.first >= 0 {
		sl = b.svc.slots[s.first]
		p, g := sl.current()
		base, gen = p.url, g
	}
	u, err := url.Parse(base)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(req.Context(), attemptTimeout)
	defer cancel()
	out := req.Clone(ctx)
	out.URL.Scheme, out.URL.Host, out.Host = u.Scheme, u.Host, ""
	a := attempt{slot: sl.id, gen: gen, from: time.Now()}
	resp, err := b.base.RoundTrip(out)
	var body []byte
	if err == nil {
		body, err = io.ReadAll(resp.Body)
		resp.Body.Close()
	}
	a.d, a.err = time.Since(a.from), err
	if resp != nil && err == nil {
		a.status, a.replayed = resp.StatusCode, resp.Header.Get(idempotency.HeaderReplayed) == "true"
	}
	s.attempts = append(s.attempts, a)
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	return resp, nil
}

// load is the clients: the senders they ran, and the answered keys they may
// send again.
type load struct {
	svc    *service
	client *http.Client
	seed   uint64
	next   atomic.Int64 // the last logical charge's number

	mu       sync.Mutex
	senders  []*sender
	answered []*sender // each key's first sender to get a 201
}

func newLoad(svc *service, seed uint64) *load {
	base := &http.Transport{MaxIdleConnsPerHost: 64, IdleConnTimeout: 30 * time.Second}
	return &load{svc: svc, seed: seed, client: &http.Client{Transport: &idempotency.Transport{
		Base: &balancer{svc: svc, base: base},
		// Until chargeDeadline: the soak wants every charge answered.
		// Retry-After (1s) is honoured; other waits are short.
		Retry: idempotency.RetryPolicy{MaxAttempts: 1 << 20, BaseDelay: 50 * time.Millisecond, MaxDelay: 2 * time.Second},
	}}}
}

// run starts clients goroutines that make charges until stop is done, and
// returns once every charge they started has its final answer or its
// deadline passed (or ctx is done).
func (l *load) run(ctx, stop context.Context, clients int) {
	var wg sync.WaitGroup
	for c := range clients {
		wg.Go(func() {
			r := rand.New(rand.NewPCG(l.seed, uint64(c)))
			account := fmt.Sprintf("acct_%d", c)
			for stop.Err() == nil {
				roll := r.Float64()
				if roll < 0.1 {
					if old := l.oldAnswer(r); old != nil {
						l.send(ctx, l.resend(old, r))
						continue
					}
				}
				n := l.next.Add(1)
				s := &sender{key: fmt.Sprintf("soak-%d-%d", l.seed, n), account: account, amount: n,
					body: fmt.Sprintf(`{"amount":%d,"currency":"usd","source":"tok_visa"}`, n), first: -1,
					r: rand.New(rand.NewPCG(l.seed, uint64(n)<<8))}
				if roll < 0.2 && len(l.svc.slots) > 1 {
					// The same charge sent twice at once, to two instances.
					twin := *s
					s.first = r.IntN(len(l.svc.slots))
					twin.first = (s.first + 1 + r.IntN(len(l.svc.slots)-1)) % len(l.svc.slots)
					twin.duplicate, twin.r = true, rand.New(rand.NewPCG(l.seed, uint64(n)<<8|1))
					var tw sync.WaitGroup
					tw.Go(func() { l.send(ctx, &twin) })
					l.send(ctx, s)
					tw.Wait()
					continue
				}
				l.send(ctx, s)
			}
		})
	}
	wg.Wait()
}

// oldAnswer is a key answered at least resendAfter ago, or nil.
func (l *load) oldAnswer(r *rand.Rand) *sender {
	l.mu.Lock()
	defer l.mu.Unlock()
	for range 3 {
		if len(l.answered) == 0 {
			return nil
		}
		s := l.answered[r.IntN(len(l.answered))]
		if time.Since(s.from.Add(s.d)) >= resendAfter {
			return s
		}
	}
	return nil
}

// resend is a new sender of old's key and request.
func (l *load) resend(old *sender, r *rand.Rand) *sender {
	return &sender{key: old.key, account: old.account, body: old.body, amount: old.amount, first: -1,
		duplicate: true, resend: true, r: rand.New(rand.NewPCG(r.Uint64(), r.Uint64()))}
}

// send runs s to its final answer and keeps it.
func (l *load) send(ctx context.Context, s *sender) {
	ctx, cancel := context.WithTimeout(context.WithValue(ctx, senderKey{}, s), chargeDeadline)
	defer cancel()
	s.from = time.Now()
	s.final, s.err = l.post(ctx, s)
	s.d = time.Since(s.from)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.senders = append(l.senders, s)
	if s.err == nil && s.final.status == http.StatusCreated && !s.duplicate {
		l.answered = append(l.answered, s)
	}
}

func (l *load) post(ctx context.Context, s *sender) (answer, error) {
	// The URL's host is the balancer's to fill in.
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://payments/v1/charges", strings.NewReader(s.body))
	if err != nil {
		return answer{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Account-ID", s.account)
	req.Header.Set(idempotency.HeaderKey, s.key)
	resp, err := l.client.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return answer{status: resp.StatusCode, header: resp.Header, body: body,
		replayed: resp.Header.Get(idempotency.HeaderReplayed) == "true"}, err
}
