//! The outbox ([`crate::store::outbox`]): a persistent znode per parcel
//! under `{base}/outbox`, named by its id; a parcel is taken by the delete
//! of its znode at the version read, which one taker alone can make.

use super::*;
use crate::store::{Outbox, Parcel, outbox};

#[async_trait]
impl Outbox for ZkStore {
    async fn hand_over(&self, parcels: &[Parcel]) -> Result<(), StoreError> {
        outbox::checked(self.url.redacted(), parcels)?;
        if parcels.is_empty() {
            return Ok(());
        }
        let client = self.client().await?;
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        // A store prepared by a version without the outbox has no
        // directory for it yet.
        let dir = self.paths.dir(Kind::Outbox);
        self.timed(client.mkdir(&dir, &persistent)).await?;
        for p in parcels {
            let path = self.paths.of(Kind::Outbox, &p.id);
            // Replaced where it is; created where it is not (or was taken
            // between the two calls).
            let mut written = false;
            for _ in 0..3 {
                match self
                    .within(client.create(&path, p.body.as_bytes(), &persistent))
                    .await?
                {
                    Ok(_) => {}
                    Err(zk::Error::NodeExists) => {
                        match self
                            .within(client.set_data(&path, p.body.as_bytes(), None))
                            .await?
                        {
                            Ok(_) => {}
                            Err(zk::Error::NoNode) => continue,
                            Err(e) => return Err(self.err(e)),
                        }
                    }
                    Err(e) => return Err(self.err(e)),
                }
                written = true;
                break;
            }
            if !written {
                return Err(StoreError::Backend {
                    store: self.url.redacted().into(),
                    reason: format!("the outbox's {} kept changing under the write", p.id),
                });
            }
        }
        Ok(())
    }

    async fn take_handed_over(
        &self,
        _taker: &Owner,
        prefix: &str,
        max: usize,
    ) -> Result<Vec<Parcel>, StoreError> {
        let until = tokio::time::Instant::now() + self.op_timeout / 2;
        let client = self.client().await?;
        let mut ids = match self
            .timed(client.list_children(&self.paths.dir(Kind::Outbox)))
            .await
        {
            Ok(ids) => ids,
            Err(StoreError::NotMigrated { .. }) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        ids.retain(|id| id.starts_with(prefix));
        ids.sort();
        ids.truncate(max);
        let client = &client;
        outbox::one_by_one(ids, until, |id| async move {
            let path = self.paths.of(Kind::Outbox, &id);
            let (data, stat) = match self.within(client.get_data(&path)).await? {
                Ok(read) => read,
                Err(zk::Error::NoNode) => return Ok(None),
                Err(e) => return Err(self.err(e)),
            };
            match self
                .within(client.delete(&path, Some(stat.version)))
                .await?
            {
                Ok(()) => Ok(Some(Parcel {
                    id,
                    body: String::from_utf8_lossy(&data).into_owned(),
                })),
                Err(zk::Error::NoNode | zk::Error::BadVersion) => Ok(None),
                Err(e) => Err(self.err(e)),
            }
        })
        .await
    }
}
