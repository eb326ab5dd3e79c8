package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"

	"github.com/idempotency-go/idempotency"
)

// chargeRequest is the body of POST /v1/charges.
type chargeRequest struct {
	Amount   int64  `json:"amount"`   // in the currency's smallest unit
	Currency string `json:"currency"` // ISO 4217, lower case
	Source   string `json:"source"`   // a card token
}

// api serves the payments API. Everything it keeps is in the gateway and the
// ledger, which every instance shares, so any number of instances act as
// one service.
type api struct {
	gateway gateway
	ledger  ledger
	metrics http.Handler // GET /metrics; nil: not mounted
}

// routes mounts the API. Only POST /v1/charges is guarded: its handler runs
// at most once per (X-Account-ID, Idempotency-Key), on whichever instance;
// GET /metrics, like the other reads, is not.
func (a *api) routes(guard *idempotency.Guard) http.Handler {
	guarded := guard.Middleware(idempotency.MiddlewareOptions{
		// Keys belong to an account: two accounts never share a record,
		// whatever keys their clients choose.
		Scope: func(r *http.Request) (string, error) { return r.Header.Get("X-Account-ID"), nil },
	})
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", guarded(http.HandlerFunc(a.createCharge)))
	mux.HandleFunc("GET /v1/charges", a.listCharges)
	mux.HandleFunc("GET /v1/charges/{id}", a.getCharge)
	mux.HandleFunc("GET /v1/gateway", a.gatewayStats)
	if a.metrics != nil {
		mux.Handle("GET /metrics", a.metrics)
	}
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok") })
	return mux
}

func (a *api) createCharge(w http.ResponseWriter, r *http.Request) {
	req, err := decodeChargeRequest(r.Body)
	if err != nil {
		// 400 is forgotten by the middleware: the client may correct the
		// body and send it again under the same key.
		writeProblem(w, http.StatusBadRequest, "invalid-charge", "Invalid charge", err.Error())
		return
	}
	ctx := r.Context()
	// The provider's key comes from the operation, not from the client's
	// key: every attempt at this operation, on any instance, sends the same
	// one, so a takeover after a crash gets the original charge back
	// instead of charging the card twice.
	key, err := idempotency.DownstreamKey(ctx, "gateway")
	if err != nil {
		http.Error(w, "charges are served through the idempotency middleware only", http.StatusInternalServerError)
		return
	}
	c, err := a.gateway.charge(ctx, key, req)
	if err != nil {
		// A 5xx releases the key: the client's retry calls the gateway
		// again, with the same downstream key.
		log.Printf("gateway: %v", err)
		writeProblem(w, http.StatusServiceUnavailable, "gateway-unavailable", "Payment gateway unavailable",
			"The payment gateway could not be reached; retry with the same Idempotency-Key.")
		return
	}
	resp, err := chargeCreated(c)
	if err != nil {
		internalError(w, "encoding", err)
		return
	}
	completed, err := a.recordCharge(ctx, c, resp)
	if err != nil {
		log.Printf("ledger: %v", err)
		writeProblem(w, http.StatusServiceUnavailable, "ledger-unavailable", "Charge not recorded",
			"The charge could not be recorded; retry with the same Idempotency-Key.")
		return
	}
	if !completed {
		writeResponse(w, resp) // the middleware stores it, then sends it
	}
}

// recordCharge writes c to the ledger under the attempt's fencing token,
// which lets the ledger refuse an attempt that was taken over (it stalled
// past its lease) and wakes up late. A ledger in the idempotency store's
// database also completes the operation with answer in the same
// transaction, and recordCharge reports true: the middleware then sends
// answer, exactly what was committed, and the handler writes nothing.
func (a *api) recordCharge(ctx context.Context, c charge, answer idempotency.Response) (completed bool, err error) {
	info, _ := idempotency.FromContext(ctx) // always there: the Guard runs the handler and the hook
	if tl, ok := a.ledger.(transactionalLedger); ok {
		return true, tl.recordCompleting(ctx, c, info.Token, answer)
	}
	return false, a.ledger.record(ctx, c, info.Token)
}

// recoverCharge is the Guard's Options.Recover. It runs, as the record's new
// owner, when an attempt at a charge was abandoned: its instance died or
// stalled past its lease somewhere between claiming the key and storing its
// answer, so whether the card was charged is unknown to the service. The
// gateway knows, under the operation's downstream key.
func (a *api) recoverCharge(ctx context.Context) (idempotency.Response, error) {
	key, err := idempotency.DownstreamKey(ctx, "gateway")
	if err != nil {
		return idempotency.Response{}, err
	}
	c, charged, err := a.gateway.lookup(ctx, key)
	if err != nil {
		// Neither charging again nor answering is safe without the
		// gateway's word: the record stays abandoned for a later retry or
		// sweep, and the client is told to retry (409). Logged here, since
		// a sweep does not report a record it could not settle yet.
		log.Printf("recover: %s: %v; left abandoned", key, err)
		return idempotency.Response{}, fmt.Errorf("%w: %w", idempotency.ErrUnknown, err)
	}
	if !charged {
		// The dead attempt never reached the gateway: release the record,
		// and the handler runs now as for a first attempt.
		log.Printf("recover: %s never charged; released for the handler to run", key)
		idempotency.SetDisposition(ctx, idempotency.Release)
		return idempotency.Response{}, nil
	}
	// The dead attempt charged, and may or may not have written the
	// ledger. This attempt's token is greater than the dead one's, so this
	// write goes through, and a stalled owner that wakes up later cannot
	// overwrite it.
	resp, err := chargeCreated(c)
	if err != nil {
		return idempotency.Response{}, err
	}
	if _, err := a.recordCharge(ctx, c, resp); err != nil {
		return idempotency.Response{}, fmt.Errorf("ledger: %w", err)
	}
	log.Printf("recover: %s had charged %s; recorded it", key, c.ID)
	return resp, nil
}

// chargeCreated is the answer to a charge the gateway made. The handler
// sends it and the recovery hook stores it, so a client gets the same bytes
// whichever of them settled the operation.
func chargeCreated(c charge) (idempotency.Response, error) {
	resp, err := jsonResponse(http.StatusCreated, c)
	if err != nil {
		return idempotency.Response{}, err
	}
	resp.Header.Set("Location", "/v1/charges/"+c.ID)
	return resp, nil
}

// decodeChargeRequest reads exactly one JSON object with known fields and
// valid values.
func decodeChargeRequest(body io.Reader) (chargeRequest, error) {
	var req chargeRequest
	dec := json.NewDecoder(body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return req, fmt.Errorf("body: %w", err)
	}
	if dec.Decode(&struct{}{}) != io.EOF {
		return req, errors.New("body: more than one JSON value")
	}
	switch {
	case req.Amount <= 0:
		return req, errors.New("amount: must be a positive integer")
	case !isCurrency(req.Currency):
		return req, errors.New("currency: must be three lower-case letters")
	case req.Source == "":
		return req, errors.New("source: required")
	}
	return req, nil
}

func isCurrency(s string) bool {
	if len(s) != 3 {
		return false
	}
	for i := range len(s) {
		if s[i] < 'a' || s[i] > 'z' {
			return false
		}
	}
	return true
}

func (a *api) listCharges(w http.ResponseWriter, r *http.Request) {
	charges, err := a.ledger.list(r.Context())
	if err != nil {
		internalError(w, "ledger", err)
		return
	}
	writeJSON(w, http.StatusOK, charges)
}

func (a *api) getCharge(w http.ResponseWriter, r *http.Request) {
	c, err := a.ledger.get(r.Context(), r.PathValue("id"))
	switch {
	case errors.Is(err, errNotFound):
		writeProblem(w, http.StatusNotFound, "no-such-charge", "No such charge", "There is no charge with this id.")
	case err != nil:
		internalError(w, "ledger", err)
	default:
		writeJSON(w, http.StatusOK, c)
	}
}

func (a *api) gatewayStats(w http.ResponseWriter, r *http.Request) {
	s, err := a.gateway.stats(r.Context())
	if err != nil {
		internalError(w, "gateway", err)
		return
	}
	writeJSON(w, http.StatusOK, s)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	resp, err := jsonResponse(status, v)
	if err != nil {
		internalError(w, "encoding", err)
		return
	}
	writeResponse(w, resp)
}

// jsonResponse is v encoded as the body of a JSON response.
func jsonResponse(status int, v any) (idempotency.Response, error) {
	body, err := json.Marshal(v)
	if err != nil {
		return idempotency.Response{}, err
	}
	return idempotency.Response{Status: status, Header: http.Header{"Content-Type": {"application/json"}},
		Body: append(body, '\n')}, nil
}

// writeResponse sends resp as it is, which is how the middleware replays it.
func writeResponse(w http.ResponseWriter, resp idempotency.Response) {
	for name, vs := range resp.Header {
		w.Header()[name] = vs
	}
	w.WriteHeader(resp.Status)
	_, _ = w.Write(resp.Body)
}

// writeProblem answers with an RFC 9457 problem details object.
func writeProblem(w http.ResponseWriter, status int, name, title, detail string) {
	body, _ := json.Marshal(struct { // strings and an int: cannot fail
		Type   string `json:"type"`
		Title  string `json:"title"`
		Status int    `json:"status"`
		Detail string `json:"detail"`
	}{"https://payments.example/problems/" + name, title, status, detail})
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

func internalError(w http.ResponseWriter, what string, err error) {
	log.Printf("%s: %v", what, err)
	writeProblem(w, http.StatusInternalServerError, "internal", "Internal error", "The request could not be served.")
}
