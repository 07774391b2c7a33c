package com.example.orders;

// A Spring example, not compiled by build.sh (Spring is not on its class path). It is the
// check-then-insert handler of ../io/lockbroker/examples/CheckThenInsert.java as a Spring bean.

import io.lockbroker.client.BrokerUnavailableException;
import io.lockbroker.client.Lease;
import io.lockbroker.client.LockBroker;
import io.lockbroker.client.LockedException;
import java.time.Duration;
import org.springframework.http.HttpStatus;
import org.springframework.stereotype.Service;
import org.springframework.web.server.ResponseStatusException;

/**
 * Replaces the {@code RedisLockUtil} of the story: the count and the insert run under one lease,
 * whichever Tomcat behind nginx takes the request. The lease is renewed in the background while
 * the transaction runs and released on the way out; the fence goes into the row, so the
 * database itself refuses a writer whose lease was lost (see the repository's
 * {@code fence > last_fence} condition below).
 */
@Service
public class BusinessLogService {
    private final LockBroker broker;
    private final BusinessLogRepository repository;

    public BusinessLogService(LockBroker broker, BusinessLogRepository repository) {
        this.broker = broker;
        this.repository = repository;
    }

    /** True when this call inserted the row; false when it already existed. */
    public boolean disableDistributedSave(String businessId) {
        try (Lease lease = broker.acquire("business-log:" + businessId, Duration.ofSeconds(30), Duration.ofSeconds(5))) {
            // Lost (force-released, or the broker unreachable until the lease's end): stop.
            lease.onLost(() -> repository.abandonPendingWork(businessId));
            if (repository.count(businessId) > 0) {
                return false;
            }
            lease.ensureHeld();
            // e.g. INSERT ... WHERE NOT EXISTS (SELECT 1 FROM fences WHERE id = ? AND last_fence >= ?)
            repository.insertFenced(businessId, lease.fence());
            return true;
        } catch (LockedException e) {
            // Someone else is inserting it right now: tell the caller to come back.
            throw new ResponseStatusException(HttpStatus.CONFLICT, "busy, retry", e);
        } catch (BrokerUnavailableException e) {
            throw new ResponseStatusException(HttpStatus.SERVICE_UNAVAILABLE, "lock service unavailable", e);
        }
    }

    /** The table, behind whatever the application uses (JdbcTemplate, JPA). */
    public interface BusinessLogRepository {
        int count(String businessId);

        /** Inserts the row unless a write with a fence at least as high was already made. */
        void insertFenced(String businessId, long fence);

        /** Called from the lost-lease callback: cancel work that has not been written yet. */
        void abandonPendingWork(String businessId);
    }
}
