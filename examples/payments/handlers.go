package main

import (
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

// api serves the payments API. Everything it keeps is in the orders, the
// gateway, the receipts and the ledger, which every instance shares, so any
// number of instances act as one service.
type api struct {
	orders   orders
	gateway  gateway
	receipts receipts
	ledger   ledger
	metrics  http.Handler // GET /metrics; nil: not mounted
	resume   bool         // run a charge's steps through idempotency.Step (see step)
	crash    *crasher     // for tests: nil, or when to kill the process
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
	resp, completed, err := a.charge(r.Context(), req)
	var failed serviceError
	switch {
	case errors.As(err, &failed):
		// A 5xx releases the key: the client's retry resumes the charge
		// at the step that failed.
		log.Printf("%v", err)
		writeProblem(w, http.StatusServiceUnavailable, failed.service+"-unavailable", "Charge not completed",
			"The "+failed.service+" service failed; retry with the same Idempotency-Key to resume the charge.")
	case err != nil:
		internalError(w, "charge", err)
	case !completed:
		writeResponse(w, resp) // the middleware stores it, then sends it
	}
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
